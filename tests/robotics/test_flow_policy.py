"""Flow-matching action-chunk policy (mmpo/robotics/policy/flow.py, mmpo/robotics/flow_bc.py): the rectified-flow
target and loss, the Euler step and sampler, ReinFlow's bounded std, chain log-prob and entropy by hand and against
the official ReinFlow code, and save / load of flow BC checkpoints."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributions.normal import Normal
from torch.utils.data import DataLoader, TensorDataset

from mmpo.robotics.flow_bc import FlowBCModule
from mmpo.robotics.policy.flow import (
    FlowPolicy,
    bounded_std,
    chain_entropy,
    chain_log_prob,
    euler_step,
    euler_times,
    flow_interpolate,
    flow_target,
)
from mmpo.robotics.policy.io import load_policy, save_policy_safetensors

torch.set_num_threads(1)
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)  # 0.918939


class _Velocity(nn.Module):
    """v(x, t, s) = t + x (a known field for the Euler tests)."""

    def forward(self, x: torch.Tensor, t: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        return x + t.view(-1, 1, 1)


def test_interpolation_and_target_by_hand():
    actions, noise = torch.tensor([[[1.0, -1.0]]]), torch.tensor([[[0.5, 0.5]]])
    x_t = flow_interpolate(actions, noise, torch.tensor(0.25))
    assert torch.allclose(x_t, torch.tensor([[[0.625, 0.125]]]))  # 0.25 * 1 + 0.75 * 0.5; 0.25 * -1 + 0.75 * 0.5
    assert torch.equal(flow_target(actions, noise), torch.tensor([[[0.5, -1.5]]]))
    # the ends: t = 0 is the noise, t = 1 the data
    assert torch.equal(flow_interpolate(actions, noise, torch.tensor(0.0)), noise)
    assert torch.equal(flow_interpolate(actions, noise, torch.tensor(1.0)), actions)


def test_bc_loss_is_the_mse_to_the_conditional_velocity():
    policy = FlowPolicy(2, 1, 2, hidden_dims=[8])
    policy.network = _Velocity()
    obs, actions = torch.zeros(3, 2), torch.tensor([[[0.5], [-0.5]], [[1.0], [0.0]], [[0.0], [0.25]]])
    loss = policy.bc_loss(obs, actions, generator=torch.Generator().manual_seed(7))
    draws = torch.Generator().manual_seed(7)  # the same draws: t ~ U[0, 1) (B,), then x_0 ~ N(0, I)
    t = torch.rand(3, generator=draws)
    noise = torch.randn(actions.shape, generator=draws)
    x_t = t.view(3, 1, 1) * actions + (1 - t.view(3, 1, 1)) * noise
    expected = ((x_t + t.view(3, 1, 1) - (actions - noise)) ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # one row by hand: a = 0.5, x_0 = -0.5, t = 0.5 -> x_t = 0, v = 0.5, target 1.0: (0.5 - 1)^2 = 0.25
    row = ((0.5 * 0.5 + 0.5 * -0.5) + 0.5 - (0.5 - -0.5)) ** 2
    assert row == pytest.approx(0.25)


def test_euler_step_and_times_by_hand():
    assert torch.equal(euler_times(4), torch.tensor([0.0, 0.25, 0.5, 0.75]))
    x, v = torch.tensor([0.2, 0.9]), torch.tensor([0.4, 0.6])
    assert torch.allclose(euler_step(x, v, 2, None), torch.tensor([0.4, 1.2]))  # x + v / K
    assert torch.allclose(euler_step(x, v, 2, 1.0), torch.tensor([0.4, 1.0]))  # clamped to the action range
    with pytest.raises(ValueError, match="needs >= 1 Euler step"):
        euler_times(0)


def test_sampler_integrates_the_field_by_hand():
    """K = 2 with v = t + x: x_1 = x_0 + (0 + x_0)/2, x_2 = x_1 + (0.5 + x_1)/2, each clamped to [-1, 1]."""
    policy = FlowPolicy(1, 1, 1, denoising_steps=2, hidden_dims=[4])
    policy.network = _Velocity()
    x0 = torch.tensor([[[0.2]], [[0.9]], [[-0.8]]])
    sample = policy.sample(torch.zeros(3, 1), deterministic=True, noise=[x0])
    # 0.2 -> 0.3 -> 0.7; 0.9 -> 1.35 = 1 -> 1.75 = 1; -0.8 -> -1.2 = -1 -> -1.25 = -1
    expected = torch.tensor([[0.2, 0.3, 0.7], [0.9, 1.0, 1.0], [-0.8, -1.0, -1.0]])
    assert torch.allclose(sample.chain.view(3, 3), expected)
    assert torch.equal(sample.actions, sample.chain[:, -1])
    with pytest.raises(ValueError, match="noise must be 1 or 3 tensors"):
        policy.sample(torch.zeros(3, 1), noise=[x0, x0])
    with pytest.raises(ValueError, match="log-probs need the stochastic ReinFlow chain"):
        policy.sample(torch.zeros(3, 1), return_log_probs=True)


def test_bounded_std_by_hand():
    raw = torch.tensor([0.0, 50.0, -50.0, math.atanh(0.5)])
    std = bounded_std(raw, 0.08, 0.14)
    # raw 0: sqrt(min max) = 0.105830; +-inf: max / min; tanh = 0.5: log var at 3/4 of the way: min^0.25 max^0.75
    assert torch.allclose(std, torch.tensor([math.sqrt(0.08 * 0.14), 0.14, 0.08, 0.08 ** 0.25 * 0.14 ** 0.75]), atol=1e-6)
    assert std[0].item() == pytest.approx(0.105830, abs=1e-6)


def test_chain_log_prob_and_entropy_by_hand():
    """K = 1, one entry: x_0 = 0.5, x_1 = 0.3, mean 0.2, std 0.1."""
    chain, mean, std = torch.tensor([0.5, 0.3]).view(1, 2, 1, 1), torch.full((1, 1, 1, 1), 0.2), torch.full((1, 1, 1, 1), 0.1)
    initial = -0.5 * 0.25 - HALF_LOG_2PI  # log N(0.5; 0, 1) = -1.043939
    transition = -0.5 * 1.0 - math.log(0.1) - HALF_LOG_2PI  # log N(0.3; 0.2, 0.1) = 0.883646
    assert chain_log_prob(chain, mean, std).item() == pytest.approx((initial + transition) / 2, abs=1e-6)  # -0.080146
    assert (initial + transition) / 2 == pytest.approx(-0.080146, abs=1e-6)
    assert chain_log_prob(chain, mean, std, include_initial=False).item() == pytest.approx(transition, abs=1e-6)
    per_entry = 0.5 * math.log(2 * math.pi * math.e)  # 1.418939
    assert chain_entropy(std).item() == pytest.approx((per_entry + per_entry + math.log(0.1)) / 2, abs=1e-6)  # 0.267646
    assert chain_entropy(std, include_initial=False).item() == pytest.approx(per_entry + math.log(0.1), abs=1e-6)
    # K = 2, Ta Da = 2: the sum over steps and entries is divided by (K + 1) and by Ta Da
    chain2 = torch.zeros(1, 3, 1, 2)
    mean2, std2 = torch.zeros(1, 2, 1, 2), torch.ones(1, 2, 1, 2)
    assert chain_log_prob(chain2, mean2, std2).item() == pytest.approx(-HALF_LOG_2PI, abs=1e-6)


# ---------------------------------------------------------------------------------------- official ReinFlow code
# Transcribed from ReinFlow/ReinFlow model/flow/ft_ppo/ppoflow.py, PPOFlow.get_logprobs (commit aed2819), with
# self.* made arguments; actor_ft.forward(xt, t, cond, True, i) returns (velocity, noise std (B, Ta*Da)).
def official_get_logprobs(actor_ft, cond, x_chain, inference_steps, horizon_steps, action_dim, denoised_clip_value,
                          get_entropy=False, normalize_denoising_horizon=False, normalize_act_space_dimension=False,
                          clip_intermediate_actions=True, account_for_initial_stochasticity=False):
    act_dim_total = horizon_steps * action_dim
    logprob = 0.0
    joint_entropy = 0.0
    entropy_rate_est = 0.0
    logprob_steps = 0
    B = x_chain.shape[0]
    chains_prev = x_chain[:, :-1, :, :].flatten(-2, -1)
    chains_next = x_chain[:, 1:, :, :].flatten(-2, -1)
    chains_stds = torch.zeros_like(chains_prev)
    init_dist = Normal(torch.zeros(B, horizon_steps * action_dim), 1.0)
    logprob_init = init_dist.log_prob(x_chain[:, 0].reshape(B, -1)).sum(-1)
    if get_entropy:
        entropy_init = init_dist.entropy().sum(-1)
    if account_for_initial_stochasticity:
        logprob += logprob_init
        if get_entropy:
            joint_entropy += entropy_init
        logprob_steps += 1
    chains_vel = torch.zeros_like(chains_prev)
    dt = 1.0 / inference_steps
    steps = torch.linspace(0, 1 - dt, inference_steps).repeat(B, 1)
    for i in range(inference_steps):
        t = steps[:, i]
        xt = x_chain[:, i]
        vt, nt = actor_ft(xt, t, cond, True, i)
        chains_vel[:, i] = vt.flatten(-2, -1)
        chains_stds[:, i] = nt
        logprob_steps += 1
    chains_mean = (chains_prev + chains_vel * dt)
    if clip_intermediate_actions:
        chains_mean = chains_mean.clamp(-denoised_clip_value, denoised_clip_value)
    chains_dist = Normal(chains_mean, chains_stds)
    logprob_trans = chains_dist.log_prob(chains_next).sum(-1)
    if get_entropy:
        entropy_trans = chains_dist.entropy().sum(-1)
    logprob += logprob_trans.sum(-1)
    if get_entropy:
        joint_entropy += entropy_trans.sum(-1)
    if get_entropy:
        entropy_rate_est = joint_entropy / logprob_steps
    if normalize_denoising_horizon:
        logprob = logprob / logprob_steps
    if normalize_act_space_dimension:
        logprob = logprob / act_dim_total
        if get_entropy:
            entropy_rate_est = entropy_rate_est / act_dim_total
    return logprob, entropy_rate_est


# Transcribed from the same file, PPOFlow.get_actions (stochastic branch, save_chains, ret_logprob, the agent's
# normalize flags); the one change: dist.sample() is loc + scale * eps with the test's eps (the official clamp to
# loc +- randn_clip_value * scale is kept), so both sides use the same draws.
def official_get_actions(actor_ft, cond, x0, step_eps, inference_steps, horizon_steps, action_dim, denoised_clip_value,
                         min_sampling_denoising_std, randn_clip_value, act_min, act_max):
    B = cond.shape[0]
    dt = (1 / inference_steps) * torch.ones(B, horizon_steps, action_dim)
    steps = torch.linspace(0, 1, inference_steps).repeat(B, 1)
    x_chain = torch.zeros((B, inference_steps + 1, horizon_steps, action_dim))
    log_prob = 0.0
    log_prob_steps = 0
    xt = x0.clone()
    log_prob += Normal(torch.zeros(B, horizon_steps * action_dim), 1.0).log_prob(xt.reshape(B, -1)).sum(-1)
    log_prob_steps += 1
    x_chain[:, 0] = xt
    for i in range(inference_steps):
        t = steps[:, i]
        vt, nt = actor_ft(xt, t, cond, False, i)
        xt = xt + vt * dt
        xt = xt.clamp(-denoised_clip_value, denoised_clip_value)
        std = nt.unsqueeze(-1).reshape(xt.shape)
        std = torch.clamp(std, min=min_sampling_denoising_std)
        dist = Normal(xt, std)
        xt = (dist.loc + dist.scale * step_eps[i]).clamp_(dist.loc - randn_clip_value * dist.scale,
                                                          dist.loc + randn_clip_value * dist.scale)
        if i == inference_steps - 1:
            xt = xt.clamp_(act_min, act_max)
        log_prob += dist.log_prob(xt).sum(dim=(-2, -1))
        log_prob_steps += 1
        x_chain[:, i + 1] = xt
    log_prob = log_prob / log_prob_steps
    log_prob = log_prob / (horizon_steps * action_dim)
    return xt, x_chain, log_prob


def _reinflow_policy(steps: int, time_conditioned: bool = False) -> FlowPolicy:
    torch.manual_seed(3)
    policy = FlowPolicy(3, 2, 4, denoising_steps=steps, hidden_dims=[16, 16, 16])
    policy.enable_finetuning({"hidden_dims": [8, 8], "min_std": 0.08, "max_std": 0.14, "activation": "tanh",
                              "time_conditioned": time_conditioned})
    with torch.no_grad():  # a velocity field large enough that the clamps to [-1, 1] act
        policy.ft_network.velocity.body.output.weight.mul_(20.0)
        policy.ft_network.noise.mlp[-1].weight.mul_(10.0)  # stds across the whole [min, max] range
    return policy


def _official_actor(policy: FlowPolicy):
    def actor_ft(xt, t, cond, learn_exploration_noise, step):
        return policy.velocity(xt, t, cond), policy.noise_std(cond, t).flatten(-2, -1)
    return actor_ft


@pytest.mark.parametrize("time_conditioned", [False, True])
@pytest.mark.parametrize("include_initial", [True, False])
@pytest.mark.parametrize("steps", [1, 4])
def test_chain_log_prob_and_entropy_match_official_reinflow(include_initial, steps, time_conditioned):
    policy = _reinflow_policy(steps, time_conditioned)
    obs = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    chain = (torch.rand(6, steps + 1, 4, 2, generator=torch.Generator().manual_seed(2)) * 2.4 - 1.2)
    mine = policy.chain_log_prob(obs, chain, include_initial=include_initial)
    entropy = policy.chain_entropy(obs, include_initial=include_initial)
    official, official_entropy = official_get_logprobs(
        _official_actor(policy), obs, chain, steps, 4, 2, 1.0, get_entropy=True, normalize_denoising_horizon=True,
        normalize_act_space_dimension=True, account_for_initial_stochasticity=include_initial)
    assert torch.allclose(mine, official, atol=1e-5, rtol=1e-5)
    assert torch.allclose(entropy, official_entropy, atol=1e-6)
    assert (policy.chain_means(obs, chain).abs() <= 1.0).all() and (policy.chain_means(obs, chain).abs() == 1.0).any()


def test_time_conditioned_noise_reads_the_detached_time_embedding():
    """ReinFlow's use_time_independent_noise: false: sigma(s, t) from [time_emb(t).detach(), s]; per-step stds."""
    policy = _reinflow_policy(4, time_conditioned=True)
    noise = policy.ft_network.noise
    assert noise.time_dim == 16 and noise.mlp[0].in_features == 16 + 3
    obs = torch.randn(5, 3)
    stds = policy.step_stds(obs)
    assert stds.shape == (5, 4, 4, 2) and not torch.allclose(stds[:, 0], stds[:, 3])
    velocity = policy.ft_network.velocity
    features = velocity.time_embed(velocity.time_proj(torch.full((5,), 0.25)))
    assert torch.allclose(stds[:, 1], noise(obs, features), atol=1e-7)
    policy.chain_entropy(obs).sum().backward()  # the entropy moves the noise network, never the time embedding
    assert noise.mlp[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in velocity.parameters())
    with pytest.raises(ValueError, match="needs the flow times t"):
        policy.noise_std(obs)
    unet = FlowPolicy(3, 2, 4, backbone="unet", unet_channels=[8, 16])
    with pytest.raises(ValueError, match="needs the mlp backbone"):
        unet.enable_finetuning({"hidden_dims": [4], "min_std": 0.08, "max_std": 0.14, "time_conditioned": True})


@pytest.mark.parametrize("time_conditioned", [False, True])
def test_sampling_matches_official_reinflow_at_one_step(time_conditioned):
    """K = 1 (the official Lift / Can configs): the official sampler's time grid linspace(0, 1, K) is its log-prob
    grid i / K, so the sampled chain and its log-prob match get_actions. (For K > 1 get_actions feeds t = i / (K - 1)
    while get_logprobs re-scores at i / K; mmpo uses i / K for both, so the first PPO ratio is exactly 1.)"""
    policy = _reinflow_policy(1, time_conditioned)
    obs = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    draws = policy.draw_chain_noise(6, generator=torch.Generator().manual_seed(4))
    draws[1] = draws[1] * 2.0  # some draws beyond the +-3 clip
    sample = policy.sample(obs, noise=draws, return_log_probs=True)
    action, chain, logp = official_get_actions(_official_actor(policy), obs, draws[0], draws[1:], 1, 4, 2, 1.0, 0.08,
                                               3.0, -1.0, 1.0)
    assert torch.allclose(sample.chain, chain, atol=1e-6) and torch.equal(sample.actions, sample.chain[:, -1])
    assert torch.allclose(sample.log_probs, logp, atol=1e-5)
    # and the re-scored log-prob of the stored chain is the sampled one
    assert torch.allclose(policy.chain_log_prob(obs, sample.chain), sample.log_probs, atol=1e-5)


def test_stochastic_chain_rescores_to_its_sampled_log_prob_at_four_steps():
    policy = _reinflow_policy(4)
    obs = torch.randn(5, 3)
    sample = policy.sample(obs, return_log_probs=True, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(policy.chain_log_prob(obs, sample.chain), sample.log_probs, atol=1e-5)
    assert (sample.actions.abs() <= 1.0).all()
    # deterministic: the noise-free flow of the same networks (the means of the chain)
    plain = policy.sample(obs, deterministic=True, noise=[sample.chain[:, 0]])
    x = sample.chain[:, 0]
    for i in range(4):
        x = (x + policy.velocity(x, torch.full((5,), i / 4), obs) / 4).clamp(-1, 1)
    assert torch.allclose(plain.actions, x, atol=1e-6)


# ---------------------------------------------------------------------------------------- BC module, save / load
@pytest.fixture(scope="module")
def flow_bc_run(tmp_path_factory):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(128, 2, generator=generator) * 2 - 1
    actions = (0.5 * obs[:, :1]).unsqueeze(1).expand(128, 2, 1).contiguous()  # a = obs_0 / 2 on both steps
    module = FlowBCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, hidden_dims=[32, 32, 32], lr=3e-3,
                          lr_min=3e-3, warmup_steps=1, ema_decay=0.9, task="reach")
    root = tmp_path_factory.mktemp("flow_bc")
    trainer = pl.Trainer(max_epochs=40, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=32, shuffle=True))
    path = root / "flow_bc.ckpt"
    trainer.save_checkpoint(path)
    return module, path


def test_flow_bc_checkpoint_loads_as_the_ema_flow_policy(flow_bc_run, tmp_path):
    module, path = flow_bc_run
    policy, metadata = load_policy(path)
    assert isinstance(policy, FlowPolicy) and metadata["kind"] == "flow_bc" and metadata["task"] == "reach"
    assert metadata["policy_config"]["family"] == "flow" and policy.num_steps == 4  # FlowBCModule's default K
    ema = module.ema_policy.module.state_dict()
    assert all(torch.equal(value, ema[key]) for key, value in policy.state_dict().items())
    safetensors = save_policy_safetensors(policy, metadata, tmp_path / "policy.safetensors")
    again, _ = load_policy(safetensors)
    obs = torch.rand(8, 2) * 2 - 1
    first = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    second = again.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    assert torch.equal(first, second)


def test_flow_bc_learns_the_demonstrated_map(flow_bc_run):
    """40 epochs of flow matching on a = obs_0 / 2: the 4-step Euler samples land near it (|error| < 0.15 on
    average, where the N(0, I) start alone is ~0.8 away)."""
    _, path = flow_bc_run
    policy, _ = load_policy(path)
    obs = torch.rand(64, 2, generator=torch.Generator().manual_seed(5)) * 1.6 - 0.8
    actions = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(6)).actions
    error = (actions - 0.5 * obs[:, :1].unsqueeze(1)).abs().mean().item()
    assert error < 0.15


def test_unet_backbone_trains_and_samples():
    torch.manual_seed(0)
    policy = FlowPolicy(3, 2, 4, backbone="unet", unet_channels=[8, 16])
    obs, actions = torch.randn(4, 3), torch.rand(4, 4, 2) * 2 - 1
    loss = policy.bc_loss(obs, actions, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in policy.network.parameters())
    sample = policy.sample(obs, deterministic=True)
    assert sample.chain.shape == (4, 5, 4, 2) and (sample.actions.abs() <= 1).all()


def test_fine_tuning_freezes_the_bc_network_and_rejects_a_second_call():
    policy = FlowPolicy(2, 1, 2, hidden_dims=[8])
    policy.enable_finetuning(None)
    assert policy.ft_steps == 1 and policy.ft_network.noise is None
    assert not any(p.requires_grad for p in policy.network.parameters())
    assert all(p.requires_grad for p in policy.ft_network.parameters())
    with pytest.raises(RuntimeError, match="already enabled"):
        policy.enable_finetuning(None)
    with pytest.raises(RuntimeError, match="noise_std needs enable_finetuning"):
        policy.noise_std(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="need 0 < min_std <= max_std"):
        FlowPolicy(2, 1, 2, hidden_dims=[8]).enable_finetuning({"hidden_dims": [4], "min_std": 0.2, "max_std": 0.1})
