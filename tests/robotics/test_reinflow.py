"""ReinFlow (mmpo/robotics/reinflow.py): the chain's PPO loss against the official ReinFlow loss on fixed inputs,
the entropy bonus and log-prob clamp by hand, rollout log-probs equal to the update's re-scoring, 2 iterations on
the tiny reach task (also pipelined), checkpoints, and the errors for a wrong policy or setting."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from mmpo.robotics.config import ReinFlowConfig
from mmpo.robotics.policy.flow import FlowPolicy
from mmpo.robotics.policy.io import load_policy
from mmpo.robotics.reinflow import ReinFlowModule
from robotics.test_flow_policy import official_get_logprobs
from robotics_reach import reach_envs, reach_flow_bc_checkpoint

torch.set_num_threads(1)

SMALL = dict(env={"num_envs": 4, "n_steps": 6}, optim={"minibatch_size": 8, "mu": 2},
             critic={"warmup_iterations": 1, "hidden_dims": [16]}, reinflow={"noise_hidden_dims": [16]},
             evaluation={"every": 1, "episodes": 4}, env_factory=reach_envs)


@pytest.fixture(scope="module")
def flow_bc_checkpoint(tmp_path_factory) -> str:
    return reach_flow_bc_checkpoint(tmp_path_factory.mktemp("flow_bc") / "flow_bc.ckpt")


def _module(checkpoint: str, **overrides) -> ReinFlowModule:
    torch.manual_seed(0)
    settings = {**SMALL, **overrides}
    return ReinFlowModule(checkpoint, num_iterations=2, **settings)


# Transcribed from ReinFlow/ReinFlow model/flow/ft_ppo/ppoflow.py, PPOFlow.loss (commit aed2819), the terms the
# trainer sums (agent/finetune/reinflow/train_ppo_agent.py: loss = pg_loss + entropy_loss * ent_coef + v_loss * vf_coef;
# no BC loss, clip_vloss_coef null); get_logprobs as in test_flow_policy.py with the agent's normalize flags.
def official_ppo_flow_loss(actor_ft, critic, obs, chains, returns, advantages, oldlogprobs, *, inference_steps,
                           horizon_steps, action_dim, logprob_min, logprob_max, clip_ploss_coef,
                           account_for_initial_stochasticity=True):
    newlogprobs, entropy = official_get_logprobs(actor_ft, obs, chains, inference_steps, horizon_steps, action_dim, 1.0,
                                                 get_entropy=True, normalize_denoising_horizon=True,
                                                 normalize_act_space_dimension=True,
                                                 account_for_initial_stochasticity=account_for_initial_stochasticity)
    newlogprobs = newlogprobs.clamp(min=logprob_min, max=logprob_max)
    oldlogprobs = oldlogprobs.clamp(min=logprob_min, max=logprob_max)
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    logratio = newlogprobs - oldlogprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_ploss_coef).float().mean().item()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_ploss_coef, 1 + clip_ploss_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    newvalues = critic(obs).view(-1)
    v_loss = 0.5 * ((newvalues - returns) ** 2).mean()
    entropy_loss = -entropy.mean()
    return pg_loss, entropy_loss, v_loss, clipfrac, approx_kl


def _actor(policy: FlowPolicy):
    return lambda xt, t, cond, learn, step: (policy.velocity(xt, t, cond), policy.noise_std(cond, t).flatten(-2, -1))


@pytest.mark.parametrize("time_conditioned", [False, True])
def test_minibatch_loss_matches_the_official_reinflow_loss(flow_bc_checkpoint, time_conditioned):
    module = _module(flow_bc_checkpoint, reinflow={"noise_hidden_dims": [16], "clip": 0.05,
                                                   "noise_time_conditioned": time_conditioned})
    policy = module.policy
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(16, 2, generator=generator) * 1.2 - 0.6
    with torch.no_grad():
        _, chains, old = module.act(obs)
        for parameter in policy.ft_network.parameters():  # the "new" policy: some ratios leave the clip range
            parameter.add_(0.03 * torch.randn(parameter.shape, generator=generator))
    old = old.squeeze(1) + 0.02 * torch.randn(16, generator=generator)  # and some old log-probs past the clamp
    old[0], old[1] = 1.5, -1.4
    advantages, returns = torch.randn(16, generator=generator), torch.randn(16, generator=generator)
    pg, value, ratio, metrics = module.minibatch_loss(obs, chains, torch.zeros(16, dtype=torch.long), old, advantages,
                                                      returns)
    ref_pg, ref_entropy_loss, ref_value, ref_clipfrac, ref_kl = official_ppo_flow_loss(
        _actor(policy), module.critic, obs, chains, returns, advantages, old, inference_steps=4, horizon_steps=2,
        action_dim=1, logprob_min=-1.0, logprob_max=1.0, clip_ploss_coef=0.05)
    assert 0 < ref_clipfrac < 1  # the check covers clipped and unclipped rows
    assert pg.item() == pytest.approx((ref_pg + 0.01 * ref_entropy_loss).item(), abs=1e-6)
    assert value.item() == pytest.approx(ref_value.item(), rel=1e-6)
    # (policy/clipfrac is the core's: rows whose clip binds; ReinFlow counts every |r - 1| > clip)
    assert metrics["policy/clipfrac"].item() <= ref_clipfrac
    assert metrics["policy/approx_kl"].item() == pytest.approx(ref_kl.item(), rel=1e-4, abs=1e-8)
    # gradients reach both the velocity copy and the noise network, never the frozen BC network
    pg.backward()
    assert policy.ft_network.velocity.body.output.weight.grad.abs().sum() > 0
    assert policy.ft_network.noise.mlp[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in policy.network.parameters())


def test_entropy_bonus_and_log_prob_clamp_by_hand(flow_bc_checkpoint):
    with_bonus = _module(flow_bc_checkpoint, reinflow={"noise_hidden_dims": [16], "ent_coef": 0.5})
    without = _module(flow_bc_checkpoint, reinflow={"noise_hidden_dims": [16], "ent_coef": 0.0})
    without.load_state_dict(with_bonus.state_dict())
    obs = torch.rand(6, 2) - 0.5
    with torch.no_grad():
        _, chains, old = with_bonus.act(obs)
        args = (obs, chains, torch.zeros(6, dtype=torch.long), old.squeeze(1), torch.randn(6), torch.zeros(6))
        entropy = with_bonus.policy.chain_entropy(obs).mean()
        assert (with_bonus.minibatch_loss(*args)[0] - without.minibatch_loss(*args)[0]).item() == pytest.approx(
            -0.5 * entropy.item(), abs=1e-6)
    # entropy rate with K = 4, stds s: [1.418939 + 4 (1.418939 + log s)] / 5 per entry, s in [0.08, 0.14]
    low, high = (1.418939 + 4 * (1.418939 + math.log(0.08))) / 5, (1.418939 + 4 * (1.418939 + math.log(0.14))) / 5
    assert low < entropy.item() < high
    narrow = _module(flow_bc_checkpoint, reinflow={"noise_hidden_dims": [16], "logprob_min": -0.01,
                                                   "logprob_max": 0.01})
    with torch.no_grad():
        _, chains, logp = narrow.act(obs)
        raw = narrow.policy.chain_log_prob(obs, chains)
        assert torch.equal(logp.squeeze(1), raw.clamp(-0.01, 0.01))
        assert torch.equal(narrow.rescore(obs, chains, torch.zeros(6, dtype=torch.long)), raw.clamp(-0.01, 0.01))


@pytest.mark.parametrize("env_groups", [1, 2])
def test_two_iterations_train_the_velocity_copy_and_the_noise_network(flow_bc_checkpoint, tmp_path, env_groups):
    module = _module(flow_bc_checkpoint, env={"num_envs": 4, "n_steps": 6, "env_groups": env_groups},
                     loss={"target_kl": None}, optim={"minibatch_size": 8, "mu": 2, "lr": 1e-3})
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    metrics = module.last_metrics
    assert module.iteration == 2
    assert metrics["perf/env_steps_total"] == 2 * 4 * 6 * 2  # iterations x envs x chunk steps x act_steps
    assert metrics["policy/ratio_first_minibatch_maxdev"] < 1e-5  # the rollout's log-probs are the update's
    assert metrics["policy/minibatches"] == 6.0  # 24 env steps / 8 x 2 epochs
    assert 0.08 <= metrics["policy/noise_std"] <= 0.14
    assert all(math.isfinite(metrics[key]) for key in ("losses/policy", "losses/value", "eval/return"))
    after = module.policy.state_dict()
    moved = [key for key in after if not torch.equal(after[key], before[key])]
    assert any(key.startswith("ft_network.velocity.") for key in moved)
    assert any(key.startswith("ft_network.noise.") for key in moved)
    assert not any(key.startswith("network.") for key in moved)  # the BC network stays frozen
    path = tmp_path / "reinflow.ckpt"
    trainer.save_checkpoint(path)
    reloaded, metadata = load_policy(path)
    assert metadata["kind"] == "reinflow" and metadata["flow_finetune"]["noise"]["hidden_dims"] == [16]
    assert all(torch.equal(value, after[key]) for key, value in reloaded.state_dict().items())
    # a ReinFlow checkpoint continues as a ReinFlow start point; a different noise network is refused
    assert isinstance(_module(str(path)).policy, FlowPolicy)
    with pytest.raises(ValueError, match="was fine-tuned with"):
        _module(str(path), reinflow={"noise_hidden_dims": [32]})


def test_wrong_policy_and_settings_are_refused(flow_bc_checkpoint, tmp_path):
    from mmpo.robotics.bc import BCModule

    diffusion = BCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, hidden_dims=[8], task="reach")
    path = tmp_path / "diffusion.ckpt"
    torch.save({"state_dict": diffusion.state_dict(), "robotics": diffusion.robotics_metadata()}, path)
    with pytest.raises(ValueError, match="holds a 'bc' policy, not a flow-matching one; ReinFlow fine-tunes a flow-matching policy"):
        _module(str(path))
    with pytest.raises(ValueError, match=r"\['evaluation.sampler'\] are DPPO's diffusion-chain settings"):
        _module(flow_bc_checkpoint, evaluation={"sampler": "ddim"})
    with pytest.raises(TypeError, match="chain"):
        ReinFlowModule(flow_bc_checkpoint, chain={"ft_steps": 2}, env_factory=reach_envs)
    with pytest.raises(ValueError, match="^need 0 < min_std <= max_std, got 0.2, 0.1$"):
        ReinFlowConfig(min_std=0.2, max_std=0.1)
    module = _module(flow_bc_checkpoint)
    assert "chain" not in module.hparams and module.hparams.reinflow["clip"] == 0.01
    # the official defaults when nothing is set
    defaults = ReinFlowModule(flow_bc_checkpoint, env_factory=reach_envs)
    assert (defaults.optim.lr, defaults.optim.minibatch_size, defaults.optim.mu, defaults.loss.target_kl,
            defaults.critic_config.lr) == (2e-5, 500, 10, 0.01, 6.5e-4)
    assert defaults.clip_ranges.tolist() == [pytest.approx(0.01)]


def test_bench_flow_reach_seed0_gains(tmp_path):
    """bench/bench_flow_reach.py's seed 0 (bench/RESULTS.md, flow reach): ReinFlow -7.54 -> 0.61, FPO -7.54 -> 1.98
    mean return over 96 paired deterministic episodes after 4,032 env steps from the random-demo flow BC."""
    from bench_support import load_bench

    bench = load_bench("bench_flow_reach")
    checkpoint = bench.train_bc(bench.FlowBCModule, 0, tmp_path, denoising_steps=4)
    for method in ("reinflow", "fpo"):
        module = bench.build(method, checkpoint, 0, 21)
        before = bench.episodes(module.policy, 0, 96)
        bench._trainer(tmp_path, 1).fit(module)
        after = bench.episodes(module.policy, 0, 96)
        assert module.train_tracker.env_steps == 4032
        assert after[0].mean() > before[0].mean() + 5.0, (method, before[0].mean(), after[0].mean())
        assert after[1].mean() > before[1].mean() + 0.5, (method, before[1].mean(), after[1].mean())
