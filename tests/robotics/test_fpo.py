"""FPO (mmpo/robotics/fpo.py): the per-sample CFM losses by hand, parity with the official FPO CFM loss, ratio
and clipped surrogate on fixed inputs, the stored draws, the first ratio = 1, 2 iterations on the tiny reach task
(also pipelined), checkpoints, and the errors for a wrong policy or setting."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from mmpo.robotics.config import FPOConfig
from mmpo.robotics.fpo import FPOModule, pack_fpo_sample, unpack_fpo_sample
from mmpo.robotics.policy.flow import cfm_losses
from mmpo.robotics.policy.io import load_policy
from robotics_reach import reach_envs, reach_flow_bc_checkpoint

torch.set_num_threads(1)

SMALL = dict(env={"num_envs": 4, "n_steps": 6}, optim={"minibatch_size": 8, "mu": 2},
             critic={"warmup_iterations": 1, "hidden_dims": [16]}, evaluation={"every": 1, "episodes": 4},
             env_factory=reach_envs)


@pytest.fixture(scope="module")
def flow_bc_checkpoint(tmp_path_factory) -> str:
    return reach_flow_bc_checkpoint(tmp_path_factory.mktemp("flow_bc") / "flow_bc.ckpt")


def _module(checkpoint: str, **overrides) -> FPOModule:
    torch.manual_seed(0)
    return FPOModule(checkpoint, num_iterations=2, **{**SMALL, **overrides})


def test_cfm_losses_by_hand():
    """a = 0.5, eps = -1, tau = 0.25, v_pred = 1: the target velocity a - eps = 1.5."""
    velocity, actions = torch.ones(1, 1, 1, 1), torch.full((1, 1, 1), 0.5)
    eps, tau = torch.full((1, 1, 1, 1), -1.0), torch.full((1, 1), 0.25)
    assert cfm_losses(velocity, actions, eps, tau, "u").item() == pytest.approx(0.25)  # (1 - 1.5)^2
    # x_tau = 0.25 * 0.5 + 0.75 * -1 = -0.625; eps_pred = x_tau - tau v = -0.875; (eps - eps_pred)^2 = 0.015625
    assert cfm_losses(velocity, actions, eps, tau).item() == pytest.approx(0.015625)
    assert 0.015625 == pytest.approx(0.25 ** 2 * 0.25)  # = tau^2 x the velocity loss
    # the mean over the chunk's entries: two entries with squared errors 0.25 and 1 -> 0.625
    two = cfm_losses(torch.tensor([[[[1.0, 0.5]]]]), torch.tensor([[[0.5, 0.5]]]), torch.tensor([[[[-1.0, -1.0]]]]),
                     torch.tensor([[1.0]]), "u")
    assert two.item() == pytest.approx((0.25 + 1.0) / 2)
    with pytest.raises(ValueError, match="output_mode must be one of"):
        cfm_losses(velocity, actions, eps, tau, "eps")


# Transcribed from akanazawa/fpo playground/src/flow_policy/fpo.py (commit 418c255), FpoState._compute_cfm_loss,
# jax.numpy -> torch, with policy_mlp_output_scale 1 and the network a callable (obs, x_t, t) -> prediction. FPO's
# time runs from data (t = 0) to noise (t = 1) and its network predicts u = eps - action.
def official_compute_cfm_loss(network, obs_norm, action, eps, t, output_mode):
    samples_dim = eps.shape[-2]
    x_t = t * eps + (1.0 - t) * action[..., None, :]
    network_pred = network(obs_norm[..., None, :].expand(*obs_norm.shape[:-1], samples_dim, obs_norm.shape[-1]), x_t, t)
    if output_mode == "u":
        velocity_pred = network_pred
        velocity_gt = eps - action[..., None, :]
        out = torch.mean((velocity_pred - velocity_gt) ** 2, dim=-1)
    elif output_mode == "u_but_supervise_as_eps":
        velocity_pred = network_pred
        x0_pred = x_t - t * velocity_pred
        x1_pred = x0_pred + velocity_pred
        out = torch.mean((eps - x1_pred) ** 2, dim=-1)
    return out


# The same file, FpoState._compute_fpo_loss, "fpo" mode with average_losses_before_exp, after the advantage
# normalisation: rho_s and the clipped surrogate policy_loss.
def official_fpo_policy_loss(initial_cfm_loss, cfm_loss, gae_advantages, clipping_epsilon):
    rho_s = torch.exp(torch.mean(initial_cfm_loss, dim=-1, keepdim=True) - torch.mean(cfm_loss, dim=-1, keepdim=True))
    surrogate_loss1 = rho_s * gae_advantages[..., None]
    surrogate_loss2 = torch.clip(rho_s, 1 - clipping_epsilon, 1 + clipping_epsilon) * gae_advantages[..., None]
    return -torch.mean(torch.minimum(surrogate_loss1, surrogate_loss2)), rho_s


def _official_network(policy):
    """FPO's network in its convention from this policy's velocity field: u(x, t_fpo) = -v(x, tau = 1 - t_fpo).
    The chunk is flattened to FPO's (..., action_dim) vectors."""
    horizon, action_dim = policy.horizon, policy.action_dim

    def network(obs, x_t, t):
        lead = x_t.shape[:-1]
        x = x_t.reshape(-1, horizon, action_dim)
        v = policy.velocity(x, (1.0 - t).reshape(-1), obs.reshape(-1, obs.shape[-1]))
        return -v.reshape(*lead, horizon * action_dim)
    return network


@pytest.mark.parametrize("output_mode", ["u", "u_but_supervise_as_eps"])
def test_cfm_losses_match_official_fpo(flow_bc_checkpoint, output_mode):
    policy = _module(flow_bc_checkpoint).policy
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(5, 2, generator=generator) - 0.5
    actions = torch.rand(5, 2, 1, generator=generator) * 2 - 1
    eps = torch.randn(5, 8, 2, 1, generator=generator)
    tau = torch.randint(0, 4, (5, 8), generator=generator) / 4
    with torch.no_grad():
        mine = policy.cfm_losses(obs, actions, eps, tau, output_mode)
        official = official_compute_cfm_loss(_official_network(policy), obs, actions.flatten(1), eps.flatten(2),
                                             (1.0 - tau)[..., None], output_mode)
    assert torch.allclose(mine, official, atol=1e-6)


def test_minibatch_loss_matches_the_official_fpo_ratio_and_surrogate(flow_bc_checkpoint):
    module = _module(flow_bc_checkpoint)
    policy = module.policy
    generator = torch.Generator().manual_seed(1)
    obs = torch.rand(16, 2, generator=generator) - 0.5
    with torch.no_grad():
        _, stored, old = module.act(obs)
        for parameter in policy.ft_network.parameters():  # the "new" policy: some ratios leave [0.95, 1.05]
            parameter.add_(0.15 * torch.randn(parameter.shape, generator=generator))
    actions, eps, tau = unpack_fpo_sample(stored)
    initial = -old  # -mean_j L_old, stored per env step: the official keeps the M losses and means them
    advantages = torch.randn(16, generator=generator)
    normalized = (advantages - advantages.mean()) / (advantages.std() + 1e-8)  # DPPO's (unbiased) normalisation
    pg, _, ratio, _ = module.minibatch_loss(obs, stored, torch.zeros(16, dtype=torch.long), old.squeeze(1), advantages,
                                            torch.zeros(16))
    with torch.no_grad():
        new = policy.cfm_losses(obs, actions, eps, tau)
    official, rho = official_fpo_policy_loss(initial.expand(16, 8), new, normalized, 0.05)
    assert ((rho - 1).abs() > 0.05).any() and ((rho - 1).abs() < 0.05).any()
    assert torch.allclose(ratio, rho.squeeze(1), atol=1e-5)
    assert pg.item() == pytest.approx(official.item(), abs=1e-6)
    pg.backward()
    assert policy.ft_network.velocity.body.output.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in policy.network.parameters())


def test_stored_draws_and_first_ratio(flow_bc_checkpoint):
    module = _module(flow_bc_checkpoint, fpo={"mc_samples": 3})
    draws = module.draw_step_noise(5)
    assert [tuple(d.shape) for d in draws] == [(5, 2, 1), (5, 3, 2, 1), (5, 3)]
    assert set(draws[2].flatten().tolist()) <= {0.0, 0.25, 0.5, 0.75}  # the Euler grid i / K, K = 4
    packed = pack_fpo_sample(draws[0], draws[1], draws[2])
    assert packed.shape == (5, 7, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(unpack_fpo_sample(packed), draws))
    uniform = _module(flow_bc_checkpoint, fpo={"mc_samples": 64, "discretize_t": False}).draw_step_noise(2)[2]
    assert len(set(uniform.flatten().tolist())) == 128 and 0 <= uniform.min() and uniform.max() < 1
    obs = torch.rand(5, 2) - 0.5
    with torch.no_grad():
        actions, stored, old = module.act(obs, noise=draws)
        # the actions are the plain Euler flow from x_0 = the first draw
        assert torch.equal(actions, module.policy.sample(obs, deterministic=True, noise=[draws[0]]).actions)
        assert torch.equal(stored[:, 0], actions)
        new = module.rescore(obs, stored, torch.zeros(5, dtype=torch.long))
    assert torch.allclose(new, old.squeeze(1), atol=1e-7)  # ratio exp(0) = 1 before any update
    assert (old < 0).all()  # -mean of squared errors


@pytest.mark.parametrize("env_groups", [1, 2])
def test_two_iterations_train_the_velocity_copy(flow_bc_checkpoint, tmp_path, env_groups):
    module = _module(flow_bc_checkpoint, env={"num_envs": 4, "n_steps": 6, "env_groups": env_groups},
                     loss={"target_kl": None}, optim={"minibatch_size": 8, "mu": 2, "lr": 1e-3})
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    metrics = module.last_metrics
    assert module.iteration == 2 and metrics["perf/env_steps_total"] == 2 * 4 * 6 * 2
    assert metrics["policy/ratio_first_minibatch_maxdev"] < 1e-5
    assert metrics["policy/minibatches"] == 6.0
    assert all(math.isfinite(metrics[key]) for key in ("losses/policy", "losses/value", "eval/return"))
    after = module.policy.state_dict()
    moved = [key for key in after if not torch.equal(after[key], before[key])]
    assert moved and all(key.startswith("ft_network.velocity.") for key in moved)
    path = tmp_path / "fpo.ckpt"
    trainer.save_checkpoint(path)
    reloaded, metadata = load_policy(path)
    assert metadata["kind"] == "fpo" and metadata["flow_finetune"] == {"noise": None}
    assert all(torch.equal(value, after[key]) for key, value in reloaded.state_dict().items())


def test_wrong_policy_and_settings_are_refused(flow_bc_checkpoint, tmp_path):
    from mmpo.robotics.reinflow import ReinFlowModule

    reinflow = ReinFlowModule(flow_bc_checkpoint, reinflow={"noise_hidden_dims": [8]}, env_factory=reach_envs)
    path = tmp_path / "reinflow.ckpt"
    torch.save({"state_dict": reinflow.state_dict(), "robotics": reinflow.robotics_metadata()}, path)
    with pytest.raises(ValueError, match="was fine-tuned by ReinFlow"):
        _module(str(path))
    with pytest.raises(ValueError, match=r"\['evaluation.ddpm_std_floor'\] are DPPO's diffusion-chain settings"):
        _module(flow_bc_checkpoint, evaluation={"ddpm_std_floor": 1e-3})
    with pytest.raises(ValueError, match="^mc_samples must be >= 1, got 0$"):
        FPOConfig(mc_samples=0)
    defaults = FPOModule(flow_bc_checkpoint, env_factory=reach_envs)
    assert (defaults.fpo.mc_samples, defaults.fpo.clip, defaults.fpo.output_mode) == (8, 0.05, "u_but_supervise_as_eps")
    assert defaults.clip_ranges.tolist() == [pytest.approx(0.05)] and "chain" not in defaults.hparams
