"""A 1-D reach task written as a gymnasium env: the tiny env the DPPO and Gaussian PPO tests learn on
(tests/robotics/test_dppo.py, tests/robotics/test_gaussian_ppo.py)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from mmpo.robotics.envs import ActionChunkWrapper

EPISODE_STEPS = 12


class Reach1D(gym.Env):
    """1-D reach: obs (pos, goal), action = velocity in [-1, 1]; reward 1 inside the goal band minus distance."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = float(self.np_random.uniform(-0.3, 0.3))
        self.goal = float(self.np_random.choice([-0.6, 0.6]))
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        return np.array([self.pos, self.goal], np.float32)

    def step(self, action):
        self.pos = float(np.clip(self.pos + 0.2 * float(np.clip(action[0], -1, 1)), -1, 1))
        distance = abs(self.pos - self.goal)
        reward = float(distance < 0.15) - distance
        return self._obs(), reward, False, False, {"success": distance < 0.15}


def reach_envs(num_envs: int, seed: int, act_steps: int) -> SyncVectorEnv:
    makers = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(Reach1D(), EPISODE_STEPS), act_steps)] * num_envs
    return SyncVectorEnv(makers, autoreset_mode=AutoresetMode.SAME_STEP)


def reach_flow_bc_checkpoint(path, epochs: int = 3, denoising_steps: int = 4) -> str:
    """A flow BC checkpoint (mmpo.robotics.flow_bc.FlowBCModule, K Euler steps) on reach demos that move towards the
    goal (action sign(goal - pos)); the starting point of the ReinFlow and FPO tests."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from mmpo.robotics.flow_bc import FlowBCModule

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    obs = torch.cat([torch.rand(256, 1, generator=generator) * 0.6 - 0.3,
                     torch.randint(0, 2, (256, 1), generator=generator) * 1.2 - 0.6], dim=1)
    actions = torch.sign(obs[:, 1:] - obs[:, :1]).unsqueeze(1).expand(256, 2, 1).contiguous()
    module = FlowBCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, denoising_steps=denoising_steps,
                          hidden_dims=[32, 32, 32], lr=3e-3, lr_min=3e-3, warmup_steps=1, ema_decay=0.9,
                          export_safetensors=False, task="reach")
    trainer = pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=path.parent)
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=64, shuffle=True))
    trainer.save_checkpoint(path)
    return str(path)
