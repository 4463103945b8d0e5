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
