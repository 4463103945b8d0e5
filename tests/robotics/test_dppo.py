"""DPPO module logic on a tiny in-test gymnasium task (fast), incl. a learning run (arXiv 2409.00588)."""

from __future__ import annotations

import math

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch.utils.data import DataLoader, TensorDataset

from mmpo.robotics.bc import BCModule
from mmpo.robotics.config import merged_settings
from mmpo.robotics.dppo import DPPOModule, Rollout
from mmpo.robotics.envs import ActionChunkWrapper
from mmpo.robotics.evaluate import evaluate_policy
from mmpo.robotics.policy.io import load_policy
from mmpo.robotics.sfpo import SFPODPPOModule
from mmpo.core.slow_fast import reposition

from robotics_reach import Reach1D, reach_envs  # tests/ is on sys.path (tests/conftest.py)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bc_checkpoint(tmp_path_factory) -> str:
    """A BC policy of *random* demonstrations (uniform actions): a poor starting point to improve."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    obs = torch.cat([torch.rand(256, 1, generator=generator) * 0.6 - 0.3,
                     torch.randint(0, 2, (256, 1), generator=generator) * 1.2 - 0.6], dim=1)
    actions = torch.rand(256, 2, 1, generator=generator) * 2 - 1
    module = BCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, denoising_steps=5, hidden_dims=[64, 64, 64],
                      lr=3e-3, lr_min=3e-3, warmup_steps=1, export_safetensors=False, task="reach")
    trainer = pl.Trainer(max_epochs=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path_factory.mktemp("bc"))
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=64, shuffle=True))
    path = tmp_path_factory.mktemp("ckpt") / "bc.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def make_module(bc_checkpoint: str, **kwargs) -> DPPOModule:
    torch.manual_seed(0)
    settings = dict(_make_module_settings(), env={"num_envs": 16, "n_steps": 6})
    return DPPOModule(bc_checkpoint, **merged_settings(settings, kwargs))


def _trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, **kwargs)


def test_dppo_improves_return_on_a_tiny_reach_task(bc_checkpoint, tmp_path):
    module = make_module(bc_checkpoint)
    module.envs = module.make_envs()
    before = evaluate_policy(module.policy, module.envs, 32, seed=123)
    _trainer(tmp_path, enable_checkpointing=False).fit(module)
    envs = reach_envs(16, 0, 2)
    after = evaluate_policy(module.policy, envs, 32, seed=123)
    envs.close()
    # deterministic eval with the fine-tuned network: random-demo BC ~ -3.6; after 21 iterations ~ +8 (max ~ 10)
    assert after["return"] > before["return"] + 5.0, (before, after)
    assert after["success_rate"] >= before["success_rate"]
    assert module.last_metrics["charts/return"] > before["return"]


def test_ratio_is_one_on_the_first_minibatch_after_a_rollout(bc_checkpoint):
    module = make_module(bc_checkpoint, env={"num_envs": 4, "n_steps": 6})
    module.envs = module.make_envs()
    rollout = module.compute_advantages(module.collect_rollout())
    assert rollout.chains.shape == (6, 4, 6, 2, 1) and rollout.old_log_probs.shape == (6, 4, 5)
    obs = rollout.obs.reshape(24, 2)
    chains = rollout.chains.reshape(24, 6, 2, 1)
    sample_index = torch.arange(24).repeat_interleave(5)
    ft_index = torch.arange(5).repeat(24)
    _, _, ratio, metrics = module.minibatch_loss(
        obs[sample_index], chains[sample_index], ft_index,
        rollout.old_log_probs.reshape(24, 5)[sample_index, ft_index],
        rollout.advantages.reshape(-1)[sample_index], rollout.returns.reshape(-1)[sample_index],
    )
    assert (ratio - 1).abs().max().item() < 1e-6
    assert metrics["policy/clipfrac"].item() == 0.0
    assert metrics["policy/approx_kl"].item() < 1e-10
    # the stored old log-probs are the clamped means over (executed steps, dims): within [-5, 2]
    assert rollout.old_log_probs.min() >= -5.0 and rollout.old_log_probs.max() <= 2.0
    module.envs.close()


def test_rollout_ddim_steps_fine_tunes_a_shorter_chain_with_the_same_network(bc_checkpoint, tmp_path):
    """DDIM (eta = 1) over 3 of the BC policy's K = 5 timesteps: 3 network calls per env step instead of 5, the
    stored chain and old log-probs are re-scored exactly (ratio 1 before the first step), and a checkpoint
    rebuilds the same 3-step chain."""
    bc, _ = load_policy(bc_checkpoint)
    module = make_module(bc_checkpoint, env={"num_envs": 4, "n_steps": 6}, num_iterations=2,
                         chain={"ft_steps": 2, "rollout_ddim_steps": 3}, optim={"mu": 1})
    policy = module.policy
    assert (policy.schedule.num_chain_steps, policy.ft_steps, policy.policy_config["sampler"]) == (3, 2, "ddim")
    assert policy.schedule.timesteps.tolist() != list(range(4, -1, -1))  # strided, not the 5 DDPM steps
    assert all(torch.equal(a, b) for a, b in zip(policy.network.parameters(), bc.network.parameters()))
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(module)
    assert module.last_metrics["policy/ratio_first_minibatch_maxdev"] < 1e-5
    path = tmp_path / "ddim.ckpt"
    trainer.save_checkpoint(path)
    reloaded, metadata = load_policy(path)
    assert (reloaded.schedule.num_chain_steps, metadata["ft_steps"]) == (3, 2)
    with pytest.raises(ValueError, match=r"ft_steps \(K'\) must be in \[1, 3\]"):
        make_module(bc_checkpoint, chain={"ft_steps": 4, "rollout_ddim_steps": 3})
    with pytest.raises(ValueError, match="already runs a 3-step DDIM chain"):
        make_module(str(path), chain={"rollout_ddim_steps": 2})


def test_rollout_boundaries_use_final_obs_and_gae_bootstraps_truncations(bc_checkpoint):
    module = make_module(bc_checkpoint, env={"num_envs": 2, "n_steps": 8}, returns={"reward_scale_running": False})
    module.envs = module.make_envs()
    rollout = module.collect_rollout()
    # 12 env steps / 2 per chunk = 6 chunk steps: truncation at chunk step 5, then a new episode
    assert rollout.truncated[:, 0].tolist() == [False] * 5 + [True] + [False] * 2
    assert not rollout.terminated.any()
    assert rollout.episode_start[:, 0].tolist() == [True] + [False] * 5 + [True, False]
    # the obs reached by the truncated step is the final obs, not the next episode's first obs
    assert not torch.allclose(rollout.reached_obs[5], rollout.obs[6])
    assert torch.allclose(rollout.reached_obs[4], rollout.obs[5])
    # a constant critic V = 2 makes GAE hand-computable: delta_t = r_t + gamma * 2 - 2 everywhere
    # (truncations bootstrap); recursion cut after the truncation at t = 5 and at the rollout end
    with torch.no_grad():
        module.critic.body.output.weight.zero_()
        module.critic.body.output.bias.fill_(2.0)
    module.compute_advantages(rollout)
    gamma, lam = 0.99, 0.95
    rewards = rollout.rewards[:, 0].tolist()
    deltas = [r + gamma * 2.0 - 2.0 for r in rewards]
    expected = [0.0] * 8
    running = 0.0
    for t in range(7, -1, -1):
        cut = t == 5
        running = deltas[t] + (0.0 if cut or t == 7 else gamma * lam * running)
        expected[t] = running
    assert rollout.advantages[:, 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert torch.allclose(rollout.returns, rollout.advantages + 2.0)
    module.envs.close()


def test_critic_warmup_leaves_the_actor_untouched_and_kprime_one_is_finite(bc_checkpoint, tmp_path):
    module = make_module(bc_checkpoint, num_iterations=1, env={"num_envs": 2, "n_steps": 6}, chain={"ft_steps": 1},
                         optim={"minibatch_size": 6, "mu": 1}, critic={"warmup_iterations": 1})
    assert module.clip_ranges.tolist() == pytest.approx([0.2])  # K' = 1 -> the final clip range, not NaN
    actor_before = [p.detach().clone() for p in module.policy.ft_network.parameters()]
    critic_before = [p.detach().clone() for p in module.critic.parameters()]
    _trainer(tmp_path, enable_checkpointing=False).fit(module)
    assert all(torch.equal(a, b) for a, b in zip(actor_before, module.policy.ft_network.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, module.critic.parameters()))
    assert all(math.isfinite(v) for k, v in module.last_metrics.items() if k.startswith(("losses", "policy")))


def test_checkpoint_rebuilds_base_and_finetuned_networks(bc_checkpoint, tmp_path):
    module = make_module(bc_checkpoint, num_iterations=2, env={"num_envs": 2, "n_steps": 6},
                         optim={"minibatch_size": 30, "mu": 2}, critic={"warmup_iterations": 0})
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(module)
    path = tmp_path / "dppo.ckpt"
    trainer.save_checkpoint(path)
    policy, metadata = load_policy(path)
    assert metadata["kind"] == "dppo" and metadata["ft_steps"] == 5 and metadata["task"] == "reach"
    base, _ = load_policy(bc_checkpoint)
    # the base network is still the BC one; the fine-tuned copy moved
    assert all(torch.equal(a, b) for a, b in zip(base.network.parameters(), policy.network.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(base.network.parameters(), policy.ft_network.parameters()))
    obs = torch.tensor([[0.1, 0.6], [-0.2, -0.6]])
    expected = module.policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    got = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    assert torch.allclose(expected, got, atol=1e-6)


def test_bad_settings_are_named(bc_checkpoint):
    with pytest.raises(ValueError, match="ft_steps"):
        make_module(bc_checkpoint, chain={"ft_steps": 6})
    with pytest.raises(ValueError, match="^minibatch_size must be >= 1 or None, got 0$"):
        make_module(bc_checkpoint, optim={"minibatch_size": 0})
    with pytest.raises(ValueError, match="act_steps"):
        make_module(bc_checkpoint, env={"act_steps": 3})
    module = make_module(bc_checkpoint, env={"num_envs": 2}, env_factory=lambda **kw: gym.vector.SyncVectorEnv(
        [lambda: ActionChunkWrapper(Reach1D(), 2)] * 2, autoreset_mode=AutoresetMode.NEXT_STEP))
    with pytest.raises(ValueError, match="SAME_STEP"):
        module.make_envs()


def test_reward_scale_gamma_is_a_setting(bc_checkpoint):
    # one env, rewards 1, 1 in one episode: discounted returns 1 and 1 + gamma
    rewards, starts = np.ones((2, 1)), np.array([[True], [False]])
    scaled = {}
    for gamma in (0.5, 0.99):
        module = make_module(bc_checkpoint, env={"num_envs": 1}, returns={"reward_scale_gamma": gamma})
        scaled[gamma] = module.reward_scaler(rewards, starts)[:, 0]
    # returns [1, 1.5]: variance 0.0625 (the prior's count 1e-4 barely moves it) -> r / 0.25 = 4
    assert scaled[0.5] == pytest.approx([4.0, 4.0], rel=1e-3)
    # DPPO's 0.99 (the default): returns [1, 1.99], variance 0.245025 -> r / 0.495
    assert scaled[0.99] == pytest.approx([1 / 0.495, 1 / 0.495], rel=1e-3)
    with pytest.raises(ValueError, match="reward_scale_gamma"):
        make_module(bc_checkpoint, returns={"reward_scale_gamma": 1.5})
    with pytest.raises(ValueError, match="eval_ddpm_std_floor"):
        make_module(bc_checkpoint, evaluation={"ddpm_std_floor": -1.0})


def test_ddpm_evaluation_std_floor(bc_checkpoint, monkeypatch):
    """Deterministic DDPM chain: None = every step's mean; a floor f (official DPPO 1e-3) adds noise
    with std max(std, f), clipped to +-noise_clip, on every step but the last."""
    policy = make_module(bc_checkpoint).policy
    steps = policy.schedule.num_chain_steps
    assert policy.schedule.sampler == "ddpm" and steps == 5
    std_of_step = torch.tensor([0.5, 0.0002, 0.0002, 0.0002, 0.0002])  # above, then below the floor

    def known_step(network, x, chain_steps, obs, *, eta, schedule):  # mean x / 2, std by step
        return x / 2, std_of_step[int(chain_steps[0])].expand_as(x)

    monkeypatch.setattr(policy, "step_distribution", known_step)
    obs = torch.zeros(3, 2)
    mean_only = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(1)).actions
    draws = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 2, 1, generator=draws)
    assert torch.allclose(mean_only, x0 / 2**steps)
    floored = policy.sample(obs, deterministic=True, ddpm_eval_std_floor=1e-3, noise_clip=1.0,
                            generator=torch.Generator().manual_seed(1)).actions
    draws = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 1, generator=draws)
    for j in range(steps):
        x = x / 2
        if j < steps - 1:  # the last step is the mean
            x = x + max(float(std_of_step[j]), 1e-3) * torch.randn(3, 2, 1, generator=draws).clamp(-1.0, 1.0)
    assert torch.allclose(floored, x, atol=1e-7)
    assert not torch.allclose(floored, mean_only, atol=1e-4)

# ---------------------------------------------------------------------- SFPO around DPPO's update (mmpo/robotics/sfpo.py)

SFPO_SMALL = dict(env={"num_envs": 4, "n_steps": 4}, optim={"minibatch_size": 40, "mu": 2})


def _sfpo_module(bc_checkpoint: str, cls=SFPODPPOModule, **kwargs) -> DPPOModule:
    """A small DPPO / SFPO module whose ppo_update runs outside a Trainer (its own optimizers)."""
    module = make_module(bc_checkpoint, **SFPO_SMALL, **kwargs) if cls is DPPOModule else cls(
        bc_checkpoint, **merged_settings(_make_module_settings(), SFPO_SMALL, kwargs))
    optimizers = module.configure_optimizers()
    module.optimizers = lambda: optimizers
    module.manual_backward = lambda loss: loss.backward()
    return module


def _make_module_settings() -> dict:
    return dict(num_iterations=21, chain={"ft_steps": 5, "clip_base": 0.1, "clip_final": 0.2},
                returns={"gamma": 0.99}, optim={"lr": 3e-3, "minibatch_size": 120, "mu": 8},
                critic={"warmup_iterations": 1, "hidden_dims": [64, 64, 64]},
                evaluation={"every": 0, "episodes": 32}, loss={"target_kl": None}, env_factory=reach_envs)


def _sfpo_rollout(module: DPPOModule) -> Rollout:
    module.envs = module.make_envs()
    rollout = module.compute_advantages(module.collect_rollout())
    module.envs.close()
    return rollout


def test_sfpo_update_equals_its_composition(bc_checkpoint):
    torch.manual_seed(0)
    sfpo = _sfpo_module(bc_checkpoint, sfpo_inner_steps=2, sfpo_alpha=0.5)
    plain = _sfpo_module(bc_checkpoint, cls=DPPOModule)
    plain.load_state_dict(sfpo.state_dict())
    rollout = _sfpo_rollout(sfpo)
    plain._generator.set_state(sfpo._generator.get_state())  # the minibatch permutations draw from it
    start = [p.detach().clone() for p in sfpo.policy.ft_network.parameters()]
    metrics = sfpo.ppo_update(rollout, train_actor=True)
    # the composition: two fast passes, theta_0 + 0.5 (theta_2 - theta_0), one slow pass (same generator draws)
    slow = [p.detach().clone() for p in plain.policy.ft_network.parameters()]
    plain.ppo_update(rollout, train_actor=True)
    plain.ppo_update(rollout, train_actor=True)
    reposition(list(plain.policy.ft_network.parameters()), slow, 0.5)
    expected = plain.ppo_update(rollout, train_actor=True)
    for mine, theirs in zip(sfpo.policy.ft_network.parameters(), plain.policy.ft_network.parameters()):
        assert torch.equal(mine, theirs)
    assert any(not torch.equal(a, b) for a, b in zip(start, sfpo.policy.ft_network.parameters()))
    assert metrics["sfpo/active"] == 1.0
    assert metrics["losses/policy"] == expected["losses/policy"] and math.isfinite(metrics["losses/policy"])


def test_sfpo_critic_warmup_is_plain_and_bad_settings(bc_checkpoint):
    module = _sfpo_module(bc_checkpoint)
    before = [p.detach().clone() for p in module.policy.ft_network.parameters()]
    metrics = module.ppo_update(_sfpo_rollout(module), train_actor=False)
    assert "sfpo/active" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.ft_network.parameters()))
    with pytest.raises(ValueError, match="sfpo_alpha"):
        SFPODPPOModule(bc_checkpoint, **{**_make_module_settings(), "sfpo_alpha": 0.0})
