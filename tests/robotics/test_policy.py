"""Diffusion policy: schedule parity with diffusers, sampling, per-step log-probs (DPPO arXiv 2409.00588)."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.robotics.policy import DenoisingSchedule, DiffusionPolicy, make_ddim_scheduler, make_ddpm_scheduler

torch.set_num_threads(1)


def test_schedule_betas_are_the_cosine_schedule_hand_computed():
    # alpha_bar(u) = cos((u + 0.008) / 1.008 * pi / 2)^2 ; beta_i = min(1 - abar((i+1)/K) / abar(i/K), 0.999)
    def abar(u: float) -> float:
        return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

    k = 2
    beta0 = 1 - abar(0.5) / abar(0.0)
    beta1 = min(1 - abar(1.0) / abar(0.5), 0.999)  # abar(1) = cos(pi/2)^2 ~ 0 -> capped at 0.999
    schedule = DenoisingSchedule(k)
    betas = schedule.ddpm_scheduler.betas
    assert torch.allclose(betas, torch.tensor([beta0, beta1]), atol=1e-6)
    assert beta1 == pytest.approx(0.999)
    # chain step 0 is timestep 1 (noisiest); its posterior mean coefficients (Ho et al. eq. 7):
    a1, a0 = (1 - beta0) * (1 - beta1), 1 - beta0
    assert schedule.timesteps.tolist() == [1, 0]
    assert schedule.x0_coef[0].item() == pytest.approx(math.sqrt(a0) * beta1 / (1 - a1), rel=1e-5)
    assert schedule.xt_coef[0].item() == pytest.approx(math.sqrt(1 - beta1) * (1 - a0) / (1 - a1), rel=1e-5)
    assert schedule.variance[0].item() == pytest.approx(beta1 * (1 - a0) / (1 - a1), rel=1e-5)
    # final step: alpha_prev = 1 -> x0 coefficient 1, x_t coefficient 0, variance clamped to 1e-20
    assert schedule.x0_coef[1].item() == pytest.approx(1.0)
    assert schedule.xt_coef[1].item() == pytest.approx(0.0, abs=1e-7)
    assert schedule.variance[1].item() == pytest.approx(1e-20, rel=1e-3)


@pytest.mark.parametrize("timestep", [19, 10, 3, 1])
def test_ddpm_step_mean_and_variance_match_diffusers_posterior(timestep):
    k = 20
    schedule = DenoisingSchedule(k)
    scheduler = make_ddpm_scheduler(k)
    scheduler.set_timesteps(k)
    x_t = 1.5 * torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(0))
    eps_hat = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(1))
    chain_step = torch.full((3,), k - 1 - timestep)
    mean, std = schedule.mean_std(x_t, eps_hat, chain_step)
    assert torch.allclose(std.squeeze() ** 2, scheduler._get_variance(timestep).expand(3), rtol=1e-5)
    # scheduler.step draws its noise from the generator: prev = mean + sqrt(var) * noise
    out = scheduler.step(eps_hat, timestep, x_t, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(mean + std * noise, out.prev_sample, atol=1e-5)
    assert torch.allclose(schedule.predict_x0(x_t, eps_hat, chain_step), out.pred_original_sample, atol=1e-5)


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_step_mean_and_sigma_match_diffusers(eta):
    k, steps = 20, 5
    schedule = DenoisingSchedule(k, sampler="ddim", ddim_steps=steps)
    scheduler = make_ddim_scheduler(k)
    scheduler.set_timesteps(steps)
    assert schedule.timesteps.tolist() == [16, 12, 8, 4, 0]  # "leading": i * K / steps, reversed
    x_t = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))
    eps_hat = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))
    for j, t in enumerate(scheduler.timesteps.tolist()):
        mean, sigma = schedule.mean_std(x_t, eps_hat, torch.full((2,), j), eta=eta)
        out = scheduler.step(
            eps_hat, t, x_t, eta=eta, use_clipped_model_output=True, variance_noise=torch.zeros_like(x_t)
        )
        assert torch.allclose(mean, out.prev_sample, atol=1e-5), t
        prev = t - k // steps
        expected_sigma = eta * scheduler._get_variance(t, prev).sqrt()
        assert torch.allclose(sigma.squeeze(), expected_sigma.expand(2), atol=1e-6)


def _policy(backbone="mlp", **kwargs) -> DiffusionPolicy:
    torch.manual_seed(0)
    return DiffusionPolicy(3, 2, 4, backbone=backbone, denoising_steps=6, hidden_dims=(32, 32, 32), unet_channels=(16, 32), **kwargs)


@pytest.mark.parametrize("backbone", ["mlp", "unet"])
def test_backbones_shapes_and_bc_loss_gradients(backbone):
    policy = _policy(backbone)
    obs, actions = torch.randn(5, 3), torch.rand(5, 4, 2) * 2 - 1
    loss = policy.bc_loss(obs, actions)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in policy.network.parameters())
    sample = policy.sample(obs, deterministic=True)
    assert sample.actions.shape == (5, 4, 2) and sample.chain is None


def test_bad_inputs_name_the_offending_item():
    policy = _policy()
    with pytest.raises(ValueError, match="obs must have shape"):
        policy.sample(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="actions must have shape"):
        policy.bc_loss(torch.zeros(2, 3), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="backbone"):
        DiffusionPolicy(3, 2, 4, backbone="transformer")
    with pytest.raises(ValueError, match="ft_steps"):
        policy.enable_finetuning(7)


def test_stochastic_sampling_has_the_std_floor_and_noise_clip():
    policy = _policy()
    policy.enable_finetuning(2)
    obs = torch.zeros(4000, 3)
    out = policy.sample(obs, min_sampling_std=0.1, noise_clip=3.0, generator=torch.Generator().manual_seed(0))
    # final DDPM step has posterior std 0; the floor makes it 0.1, and the clip bounds |x0 - mean| by 0.3
    last_mean, _ = policy.step_distribution(
        policy.ft_network, out.chain[:, -2], torch.full((4000,), policy.schedule.num_chain_steps - 1), obs
    )
    residual = out.chain[:, -1] - last_mean
    assert residual.abs().max().item() <= 0.3 + 1e-5
    assert residual.std().item() == pytest.approx(0.1 * 0.9866, rel=0.05)  # std of N(0,1) clipped at 3 ~ 0.9866


def test_chain_log_prob_equals_rollout_value_when_finetuned_equals_base():
    policy = _policy()
    policy.enable_finetuning(3)
    obs = torch.randn(6, 3)
    out = policy.sample(obs, return_log_probs=True, generator=torch.Generator().manual_seed(3))
    assert out.chain.shape == (6, 4, 4, 2) and out.log_probs.shape == (6, 3, 4, 2)
    assert torch.equal(out.chain[:, -1], out.actions)
    for i in range(3):
        index = torch.full((6,), i)
        recomputed = policy.chain_step_log_prob(obs, out.chain, index)
        assert torch.allclose(recomputed, out.log_probs[:, i], atol=1e-5)
        # and by hand: Normal(mean_base, max(std, 0.1)) with the *frozen base* network (ft == base here)
        mean, std = policy.step_distribution(policy.network, out.chain[:, i], index + policy.first_ft_step, obs)
        std = std.clamp(min=0.1)
        by_hand = -((out.chain[:, i + 1] - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        assert torch.allclose(recomputed, by_hand, atol=1e-5)


def test_finetuned_copy_is_trained_and_used_by_deterministic_eval():
    policy = _policy()
    obs = torch.randn(3, 3)
    before = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    policy.enable_finetuning(2)
    assert not any(p.requires_grad for p in policy.network.parameters())
    assert all(p.requires_grad for p in policy.ft_network.parameters())
    same = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    assert torch.allclose(before, same, atol=1e-6)
    with torch.no_grad():
        policy.ft_network.body.output.bias.add_(0.5)  # changes eps_hat only on the last K' = 2 steps
    changed = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    assert not torch.allclose(before, changed, atol=1e-3)
    # the log-prob path also runs through the fine-tuned copy (gradient reaches it, not the base)
    out = policy.sample(obs, generator=torch.Generator().manual_seed(1))
    policy.chain_step_log_prob(obs, out.chain, torch.tensor([0, 1, 1])).sum().backward()
    assert policy.ft_network.body.output.bias.grad is not None
    assert policy.network.body.output.bias.grad is None


def test_ddim_policy_samples_and_logprobs():
    policy = _policy(sampler="ddim", ddim_steps=3)
    policy.enable_finetuning(3)
    obs = torch.randn(4, 3)
    out = policy.sample(obs, return_log_probs=True, generator=torch.Generator().manual_seed(0))
    assert out.chain.shape == (4, 4, 4, 2)
    recomputed = policy.chain_step_log_prob(obs, out.chain, torch.tensor([0, 1, 2, 2]))
    rows = torch.arange(4)
    assert torch.allclose(recomputed, out.log_probs[rows, torch.tensor([0, 1, 2, 2])], atol=1e-5)


def test_deterministic_ddim_twin_matches_a_manual_ddim_scheduler_loop():
    policy = _policy()
    twin = policy.deterministic_schedule("ddim")
    assert twin.timesteps.tolist() == policy.schedule.timesteps.tolist() == [5, 4, 3, 2, 1, 0]
    obs = torch.randn(3, 3)
    out = policy.sample(obs, deterministic=True, deterministic_sampler="ddim", generator=torch.Generator().manual_seed(4))
    scheduler = make_ddim_scheduler(6)
    scheduler.set_timesteps(6)
    x = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for t in scheduler.timesteps.tolist():
            eps = policy.network(x, torch.full((3,), t), obs)
            x = scheduler.step(eps, t, x, eta=0.0, use_clipped_model_output=True).prev_sample
    assert torch.allclose(out.actions, x, atol=1e-5)
    with pytest.raises(ValueError, match="deterministic sampler"):
        policy.sample(obs, deterministic=True, deterministic_sampler="euler")
