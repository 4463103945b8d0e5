"""DSRL (mmpo/robotics/dsrl.py): SAC's formulas by hand, one gradient step against stable-baselines3's SAC.train
(transcribed) on the same networks and batch, the replay buffer, steering of a frozen flow or diffusion policy, the
warm-up, 3 iterations on the reach task with the base policy untouched, and `mmpo fit` of configs/robotics/
dsrl_lift.yaml with a bit-exact resume (replay buffer included)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from mmpo.cli import main
from mmpo.robotics.bc import BCModule
from mmpo.robotics.config import DSRLConfig
from mmpo.robotics.dsrl import (
    DSRLModule,
    ReplayBuffer,
    SteeredPolicy,
    actor_loss,
    critic_loss,
    critic_target,
    ent_coef_loss,
    noise_critic_loss,
    polyak_update,
    squashed_log_prob,
)
from mmpo.robotics.flow_bc import FlowBCModule
from mmpo.robotics.policy.io import load_policy
from reliability.test_resume_robotics import assert_same_tensors, training_state
from robotics_reach import reach_envs, reach_flow_bc_checkpoint

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
SMALL = dict(dsrl={"hidden_dims": [32, 32], "utd": 2, "warmup_chunk_steps": 6, "buffer_size": 1000},
             env={"num_envs": 4, "n_steps": 6}, optim={"minibatch_size": 16},
             evaluation={"every": 0, "episodes": 4}, env_factory=reach_envs)


@pytest.fixture(scope="module")
def flow_bc_checkpoint(tmp_path_factory) -> str:
    return reach_flow_bc_checkpoint(tmp_path_factory.mktemp("flow_bc") / "flow_bc.ckpt")


def _module(checkpoint: str, **overrides) -> DSRLModule:
    torch.manual_seed(0)
    return DSRLModule(checkpoint, num_iterations=3, **{**SMALL, **overrides})


# ---------------------------------------------------------------------------------------------- formulas by hand
def test_sac_formulas_by_hand():
    # tanh-squashed Gaussian, mean 0, std 1, u = 0.5: log N(0.5) = -0.125 - 0.918939 = -1.043939;
    # tanh(0.5) = 0.462117, log(1 - 0.213552 + 1e-6) = -0.240228 -> -0.803711
    value = squashed_log_prob(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 0.5)).item()
    assert value == pytest.approx(-1.043939 - math.log(1 - math.tanh(0.5) ** 2 + 1e-6), abs=1e-6)
    assert value == pytest.approx(-0.803711, abs=1e-5)
    # two dims add; log_std 1 on dim 2: log N(0; 0, e) = -1 - 0.918939
    two = squashed_log_prob(torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.0]])).item()
    assert two == pytest.approx(value + (-1.0 - 0.918939) - math.log(1 + 1e-6), abs=1e-5)
    # target: r + (1 - d) gamma (min Q' - alpha log pi'): 1 + 0.9 (2 - 0.5 x -1) = 3.25; terminated: r only
    target = critic_target(torch.tensor([1.0, 1.0]), torch.tensor([False, True]), torch.tensor([[2.0, 3.0], [2.0, 3.0]]),
                           torch.tensor([-1.0, -1.0]), 0.5, 0.9)
    assert torch.allclose(target, torch.tensor([3.25, 1.0]))
    # critic loss: 0.5 sum_k mean_b (Q_k - y)^2 = 0.5 ((1 + 0) / 2 + (9 + 1) / 2) = 2.75
    assert critic_loss(torch.tensor([[1.0, 3.0], [2.0, 3.0]]), torch.tensor([0.0, 2.0])).item() == pytest.approx(2.75)
    # actor loss: mean(alpha log pi - min Q) = ((0.5 x -1 - 1) + (0.5 x -2 - 2)) / 2 = -2.25
    assert actor_loss(torch.tensor([-1.0, -2.0]), torch.tensor([[1.0, 3.0], [2.0, 4.0]]), 0.5).item() == pytest.approx(-2.25)
    # alpha loss: -mean(log alpha (log pi + target)) = -(log 2 x (-1 + 0.5)) = 0.346574; gradient w.r.t. log alpha 0.5
    log_alpha = torch.tensor([math.log(2.0)], requires_grad=True)
    loss = ent_coef_loss(log_alpha, torch.tensor([-1.0], requires_grad=True), 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * math.log(2.0)) and log_alpha.grad.item() == pytest.approx(0.5)
    # Polyak: 0.9 x 1 + 0.1 x 3 = 1.2
    target_param, param = torch.ones(2), torch.full((2,), 3.0)
    polyak_update([param], [target_param], 0.1)
    assert torch.allclose(target_param, torch.full((2,), 1.2))


# ---------------------------------------------------------------------------------------------- stable-baselines3
# Transcribed from DLR-RM/stable-baselines3 stable_baselines3/sac/sac.py, SAC.train (one gradient step, learned
# ent_coef, target_update_interval 1, no gSDE), with its actor / critic / critic_target / log_ent_coef / optimizers
# as arguments and actor.action_log_prob as a callable; polyak_update is stable_baselines3/common/utils.py's.
def sb3_sac_gradient_step(replay_data, action_log_prob, critic, critic_target, log_ent_coef, actor_optimizer,
                          critic_optimizer, ent_coef_optimizer, target_entropy, gamma, tau):
    actions_pi, log_prob = action_log_prob(replay_data["observations"])
    log_prob = log_prob.reshape(-1, 1)
    ent_coef = torch.exp(log_ent_coef.detach())
    ent_coef_loss = -(log_ent_coef * (log_prob + target_entropy).detach()).mean()
    ent_coef_optimizer.zero_grad()
    ent_coef_loss.backward()
    ent_coef_optimizer.step()
    with torch.no_grad():
        next_actions, next_log_prob = action_log_prob(replay_data["next_observations"])
        next_q_values = torch.cat(critic_target(replay_data["next_observations"], next_actions), dim=1)
        next_q_values, _ = torch.min(next_q_values, dim=1, keepdim=True)
        next_q_values = next_q_values - ent_coef * next_log_prob.reshape(-1, 1)
        target_q_values = replay_data["rewards"] + (1 - replay_data["dones"]) * gamma * next_q_values
    current_q_values = critic(replay_data["observations"], replay_data["actions"])
    critic_loss = 0.5 * sum(F.mse_loss(current_q, target_q_values) for current_q in current_q_values)
    critic_optimizer.zero_grad()
    critic_loss.backward()
    critic_optimizer.step()
    q_values_pi = torch.cat(critic(replay_data["observations"], actions_pi), dim=1)
    min_qf_pi, _ = torch.min(q_values_pi, dim=1, keepdim=True)
    actor_loss = (ent_coef * log_prob - min_qf_pi).mean()
    actor_optimizer.zero_grad()
    actor_loss.backward()
    actor_optimizer.step()
    with torch.no_grad():
        for param, target_param in zip(critic.parameters(), critic_target.parameters()):
            target_param.data.mul_(1 - tau)
            torch.add(target_param.data, param.data, alpha=tau, out=target_param.data)


class _SB3Critic:
    """stable-baselines3's ContinuousCritic interface over a QEnsemble: a tuple of (B, 1) Q values."""

    def __init__(self, ensemble):
        self.ensemble = ensemble

    def __call__(self, obs, actions):
        return tuple(self.ensemble(obs, actions).split(1, dim=1))

    def parameters(self):
        return self.ensemble.parameters()


def test_gradient_steps_match_stable_baselines3_sac(flow_bc_checkpoint):
    module = _module(flow_bc_checkpoint, dsrl={**SMALL["dsrl"], "target_entropy": None, "init_ent_coef": 0.3})
    actor, critic, target = (copy.deepcopy(m) for m in (module.noise_actor, module.critic, module.critic_target))
    log_ent_coef = module.log_ent_coef.detach().clone().requires_grad_(True)
    optimizers = module.configure_optimizers()
    module.optimizers = lambda: optimizers
    module.manual_backward = lambda loss: loss.backward()
    lr = module.optim.lr
    sb3_opts = (torch.optim.Adam(actor.parameters(), lr=lr), torch.optim.Adam(critic.parameters(), lr=lr),
                torch.optim.Adam([log_ent_coef], lr=lr))
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = {"obs": torch.rand(16, 2, generator=generator) - 0.5, "actions": torch.rand(16, 2, generator=generator) * 2 - 1,
                 "rewards": torch.randn(16, generator=generator), "next_obs": torch.rand(16, 2, generator=generator) - 0.5,
                 "terminated": (torch.rand(16, generator=generator) < 0.3).float()}
        module._generator.manual_seed(100 + step)
        module.sac_step(batch)
        draws = torch.Generator().manual_seed(100 + step)  # the same noise stream: actions_pi, then next_actions

        def action_log_prob(obs):
            return actor.sample(obs, generator=draws)

        sb3_sac_gradient_step({"observations": batch["obs"], "actions": batch["actions"],
                               "rewards": batch["rewards"].unsqueeze(1), "next_observations": batch["next_obs"],
                               "dones": batch["terminated"].unsqueeze(1)}, action_log_prob,
                              _SB3Critic(critic), _SB3Critic(target), log_ent_coef, *sb3_opts,
                              target_entropy=-2.0, gamma=0.99, tau=0.005)
    for mine, reference in ((module.noise_actor, actor), (module.critic, critic), (module.critic_target, target)):
        for (name, a), b in zip(mine.named_parameters(), reference.parameters()):
            assert torch.allclose(a, b, atol=1e-6), name
    assert torch.allclose(module.log_ent_coef, log_ent_coef, atol=1e-7)
    assert module.log_ent_coef.item() != pytest.approx(math.log(0.3))  # alpha moved
    assert module.gradient_steps == 3


# ---------------------------------------------------------------------------------------------- DSRL-NA
def test_noise_critic_loss_by_hand():
    # 0.5 sum_k mean_b (Q_W,k - Q_A,k)^2: critic 1 errors (1, -1) -> 1, critic 2 errors (2, 0) -> 2: 0.5 x 3 = 1.5
    q_noise = torch.tensor([[1.0, 2.0], [0.0, 3.0]], requires_grad=True)
    q_action = torch.tensor([[0.0, 0.0], [1.0, 3.0]], requires_grad=True)
    loss = noise_critic_loss(q_noise, q_action)
    loss.backward()
    assert loss.item() == pytest.approx(1.5)
    assert q_action.grad is None  # the action critic is the target: detached
    assert torch.allclose(q_noise.grad, torch.tensor([[0.5, 1.0], [-0.5, 0.0]]))  # (Q_W - Q_A) / B


# Transcribed from the DSRL-NA class of the authors' stable-baselines3 fork (ajwagen/stable-baselines3-dsrl,
# read in its public copy songgaogy/stable-baselines3-dsrl, stable_baselines3/dsrl/dsrl.py @ b08130c:
# DSRL.train and DSRL.update_noise_critic; learned ent_coef, actor_gradient_steps -1 (the actor steps on every
# gradient step), target_update_interval 1, critic_backup_combine_type min). Its env action box is [-1, 1]^(Ta Da)
# (DPPO's robomimic wrapper), so policy.scale_action / unscale_action are the identity and left out. The replay
# samples, the actor's action_log_prob and the diffusion policy are arguments.
def fork_dsrl_na_train(replay_batches, distill_batches, action_log_prob, actor_optimizer, critic, critic_target,
                       critic_noise, critic_optimizer, critic_noise_optimizer, log_ent_coef, ent_coef_optimizer,
                       target_entropy, gamma, tau, diffusion_policy, diffusion_act_chunk, diffusion_act_dim, draws):
    for replay_data in replay_batches:
        actions_pi, log_prob = action_log_prob(replay_data["observations"])
        log_prob = log_prob.reshape(-1, 1)
        ent_coef = torch.exp(log_ent_coef.detach())
        ent_coef_loss = -(log_ent_coef * (log_prob + target_entropy).detach()).mean()
        ent_coef_optimizer.zero_grad()
        ent_coef_loss.backward()
        ent_coef_optimizer.step()
        with torch.no_grad():
            next_actions, next_log_prob = action_log_prob(replay_data["next_observations"])
            next_actions = diffusion_policy(replay_data["next_observations"],
                                            next_actions.reshape(-1, diffusion_act_chunk, diffusion_act_dim),
                                            return_numpy=False)
            next_actions = next_actions.reshape(-1, diffusion_act_chunk * diffusion_act_dim)
            next_q_values = torch.cat(critic_target(replay_data["next_observations"], next_actions), dim=1)
            next_q_values, _ = torch.min(next_q_values, dim=1, keepdim=True)
            next_q_values = next_q_values - ent_coef * next_log_prob.reshape(-1, 1)
            target_q_values = replay_data["rewards"] + (1 - replay_data["dones"]) * gamma * next_q_values
        current_q_values = critic(replay_data["observations"], replay_data["actions"])
        critic_loss = 0.5 * sum(F.mse_loss(current_q, target_q_values) for current_q in current_q_values)
        critic_optimizer.zero_grad()
        critic_loss.backward()
        critic_optimizer.step()
        q_values_pi = torch.cat(critic_noise(replay_data["observations"], actions_pi), dim=1)
        min_qf_pi, _ = torch.min(q_values_pi, dim=1, keepdim=True)
        actor_loss = (ent_coef * log_prob - min_qf_pi).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()
        with torch.no_grad():
            for param, target_param in zip(critic.parameters(), critic_target.parameters()):
                target_param.data.mul_(1 - tau)
                torch.add(target_param.data, param.data, alpha=tau, out=target_param.data)
    for replay_data in distill_batches:  # update_noise_critic, noise_critic_grad_steps times
        with torch.no_grad():
            noise_actions = torch.randn(replay_data["actions"].shape[0], diffusion_act_chunk, diffusion_act_dim,
                                        generator=draws)
            diffused_actions = diffusion_policy(replay_data["observations"], noise_actions, return_numpy=False)
            diffused_actions = diffused_actions.reshape(-1, diffusion_act_chunk * diffusion_act_dim)
            current_q_values = critic(replay_data["observations"], diffused_actions)
        noise_actions = noise_actions.reshape(-1, diffusion_act_chunk * diffusion_act_dim)
        current_q_noise_vals = critic_noise(replay_data["observations"], noise_actions)
        critic_distill_loss = 0
        for i in range(len(current_q_values)):
            critic_distill_loss = critic_distill_loss + 0.5 * F.mse_loss(current_q_values[i].detach(),
                                                                        current_q_noise_vals[i])
        critic_noise_optimizer.zero_grad()
        critic_distill_loss.backward()
        critic_noise_optimizer.step()


def _na_module(checkpoint: str, **dsrl) -> DSRLModule:
    return _module(checkpoint, dsrl={**SMALL["dsrl"], "algorithm": "dsrl_na", "noise_critic_grad_steps": 2, **dsrl})


def test_dsrl_na_steps_match_the_authors_fork(flow_bc_checkpoint):
    module = _na_module(flow_bc_checkpoint, target_entropy=None, init_ent_coef=0.3)
    assert module.noise_magnitude == 1.0 and module.noise_critic is not None
    actor, critic, target, noise_critic = (copy.deepcopy(m) for m in (
        module.noise_actor, module.critic, module.critic_target, module.noise_critic))
    log_ent_coef = module.log_ent_coef.detach().clone().requires_grad_(True)
    optimizers = module.configure_optimizers()
    assert len(optimizers) == 4  # actor, action critic, alpha, noise critic
    module.optimizers = lambda: optimizers
    module.manual_backward = lambda loss: loss.backward()
    lr = module.optim.lr
    fork_opts = dict(actor_optimizer=torch.optim.Adam(actor.parameters(), lr=lr),
                     critic_optimizer=torch.optim.Adam(critic.parameters(), lr=lr),
                     critic_noise_optimizer=torch.optim.Adam(noise_critic.parameters(), lr=lr),
                     ent_coef_optimizer=torch.optim.Adam([log_ent_coef], lr=lr))
    base = copy.deepcopy(module.policy)

    def diffusion_policy(obs, noise, return_numpy=False):  # the frozen flow's Euler chain from x_0 = noise
        return base.sample(obs, deterministic=True, noise=[noise]).actions

    generator = torch.Generator().manual_seed(0)

    def batch():
        return {"obs": torch.rand(16, 2, generator=generator) - 0.5,
                "actions": torch.rand(16, 2, generator=generator) * 2 - 1,
                "rewards": torch.randn(16, generator=generator), "next_obs": torch.rand(16, 2, generator=generator) - 0.5,
                "terminated": (torch.rand(16, generator=generator) < 0.3).float()}

    def fork_batch(b):
        return {"observations": b["obs"], "actions": b["actions"], "rewards": b["rewards"].unsqueeze(1),
                "next_observations": b["next_obs"], "dones": b["terminated"].unsqueeze(1)}

    for call in range(2):  # two train() calls: utd 2 SAC steps, then 2 distillation steps
        sac_batches, distill_batches = [batch(), batch()], [batch(), batch()]
        module._generator.manual_seed(100 + call)
        for b in sac_batches:
            module.sac_step(b)
        for b in distill_batches:
            module.distill_step(b)
        draws = torch.Generator().manual_seed(100 + call)  # one stream: the actor's draws, then the distillation noise

        def action_log_prob(obs):
            return actor.sample(obs, generator=draws)

        fork_dsrl_na_train([fork_batch(b) for b in sac_batches], [fork_batch(b) for b in distill_batches],
                           action_log_prob, critic=_SB3Critic(critic), critic_target=_SB3Critic(target),
                           critic_noise=_SB3Critic(noise_critic), log_ent_coef=log_ent_coef, target_entropy=-2.0,
                           gamma=0.99, tau=0.005, diffusion_policy=diffusion_policy, diffusion_act_chunk=2,
                           diffusion_act_dim=1, draws=draws, **fork_opts)
    for mine, reference in ((module.noise_actor, actor), (module.critic, critic), (module.critic_target, target),
                            (module.noise_critic, noise_critic)):
        for (name, a), b in zip(mine.named_parameters(), reference.parameters()):
            assert torch.allclose(a, b, atol=1e-6), name
    assert torch.allclose(module.log_ent_coef, log_ent_coef, atol=1e-7)
    start = _na_module(flow_bc_checkpoint).noise_critic  # the same seed builds the same initial networks
    assert any(not torch.equal(a, b) for a, b in zip(module.noise_critic.parameters(), start.parameters()))


def test_dsrl_na_stores_chunks_distills_and_keeps_the_base_frozen(flow_bc_checkpoint, tmp_path):
    module = _na_module(flow_bc_checkpoint, warmup_chunk_steps=7)
    base = {k: v.clone() for k, v in module.policy.state_dict().items()}
    noise_critic = {k: v.clone() for k, v in module.noise_critic.state_dict().items()}
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    # iterations 0, 1 warm up; iteration 2: 6 chunk steps x (utd 2 SAC steps x 3 optimizers + 2 distillation steps)
    assert module.gradient_steps == 12 and trainer.global_step == 6 * (2 * 3 + 2)
    assert module.last_metrics["losses/noise_critic"] > 0
    # the buffer holds the executed chunks: the frozen flow's Euler chain, clamped to [-1, 1] at every step
    stored = module.buffer.actions[: module.buffer.size]
    assert stored.abs().max() <= 1.0 and module.buffer.size == 3 * 6 * 4
    obs = module.buffer.obs[:4]
    noise = torch.randn(4, 2)
    assert torch.equal(module.steer(obs, noise), module.policy.sample(obs, deterministic=True,
                                                                      noise=[noise.view(4, 2, 1)]).actions)
    assert all(torch.equal(v, base[k]) for k, v in module.policy.state_dict().items())
    assert any(not torch.equal(v, noise_critic[k]) for k, v in module.noise_critic.state_dict().items())
    # the warm-up plays w ~ N(0, I) unclipped through the frozen chain and stores the chunk (ajwagen/dsrl utils.py
    # collect_rollouts: the clip to [-m, m] is dsrl_sac's only)
    fresh = _na_module(flow_bc_checkpoint)
    assert fresh.warming_up()
    obs = torch.rand(64, 2) - 0.5
    fresh._generator.manual_seed(7)
    chunks, stored, _ = fresh.act(obs)
    noise = torch.randn((64, 2), generator=torch.Generator().manual_seed(7))
    assert noise.abs().max() > 1.5  # some draws beyond [-1, 1] and beyond dsrl_sac's 1.5
    assert torch.equal(chunks, fresh.steer(obs, noise)) and torch.equal(stored, chunks.reshape(64, 2))
    assert not torch.equal(chunks, fresh.steer(obs, noise.clamp(-1.5, 1.5)))
    with pytest.raises(ValueError, match=r"dsrl.algorithm must be one of \['dsrl_sac', 'dsrl_na'\], got 'na'"):
        DSRLConfig(algorithm="na")


# ---------------------------------------------------------------------------------------------- pieces
def test_replay_buffer_overwrites_samples_and_restores():
    buffer = ReplayBuffer(3, obs_dim=1, action_dim=1, seed=5)
    for start in (0, 2):  # 4 transitions into 3 slots: the first is overwritten
        values = torch.arange(start, start + 2, dtype=torch.float32)
        buffer.add(values.view(2, 1), values.view(2, 1), values, values.view(2, 1) + 1, torch.tensor([False, True]))
    assert buffer.size == 3 and buffer.position == 1
    assert buffer.obs.view(-1).tolist() == [3.0, 1.0, 2.0] and buffer.terminated.tolist() == [1.0, 1.0, 0.0]
    state = buffer.state_dict()
    first = buffer.sample(8)
    restored = ReplayBuffer(3, obs_dim=1, action_dim=1, seed=0)
    restored.load_state_dict(state)
    second = restored.sample(8)
    assert all(torch.equal(first[k], second[k]) for k in first)  # the sampling stream is part of the state
    assert set(first["obs"].view(-1).tolist()) <= {1.0, 2.0, 3.0}
    big = ReplayBuffer(2, obs_dim=1, action_dim=1)  # more rows than slots: the last 2, in order
    five = torch.arange(5, dtype=torch.float32)
    big.add(five.view(5, 1), five.view(5, 1), five, five.view(5, 1), torch.zeros(5, dtype=torch.bool))
    assert big.obs.view(-1).tolist() == [4.0, 3.0] and (big.position, big.size) == (1, 2)
    with pytest.raises(ValueError, match="more than buffer_size=2"):
        ReplayBuffer(2, 1, 1).load_state_dict(state)


def test_steering_plays_the_frozen_chain_from_the_noise(flow_bc_checkpoint, tmp_path):
    module = _module(flow_bc_checkpoint)
    obs, squashed = torch.rand(5, 2) - 0.5, torch.rand(5, 2) * 2 - 1
    expected = module.policy.sample(obs, deterministic=True, noise=[1.5 * squashed.view(5, 2, 1)]).actions
    assert torch.equal(module.steer(obs, squashed), expected)
    diffusion = BCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, denoising_steps=5, hidden_dims=[8],
                         task="reach")
    path = tmp_path / "diffusion.ckpt"
    torch.save({"state_dict": diffusion.state_dict(), "robotics": diffusion.robotics_metadata()}, path)
    for ddim_steps, chain_steps in ((None, 5), (3, 3)):  # DDIM over all K = 5 timesteps, or 3 strided ones (official 8)
        steered = _module(str(path), dsrl={**SMALL["dsrl"], "ddim_steps": ddim_steps})
        policy = steered.policy
        x = 1.5 * squashed.view(5, 2, 1)
        schedule = policy.deterministic_schedule("ddim")  # DDIM eta = 0 from x_K = w, by hand
        assert schedule.num_chain_steps == chain_steps
        for j in range(schedule.num_chain_steps):
            steps = torch.full((5,), j, dtype=torch.long)
            x, _ = policy.step_distribution(policy.network, x, steps, obs, eta=0.0, schedule=schedule)
        assert torch.allclose(steered.steer(obs, squashed), x, atol=1e-6)
    assert torch.equal(policy.network.body.output.weight, diffusion.ema_policy.module.network.body.output.weight)
    with pytest.raises(ValueError, match="initial_noise must be one tensor of shape"):
        policy.sample(obs, deterministic=True, initial_noise=torch.zeros(5, 3, 1))
    with pytest.raises(ValueError, match="^action_magnitude must be > 0, got 0.0$"):
        DSRLConfig(action_magnitude=0.0)


def test_warmup_then_sac_and_the_base_policy_stays_frozen(flow_bc_checkpoint, tmp_path):
    module = _module(flow_bc_checkpoint, dsrl={**SMALL["dsrl"], "warmup_chunk_steps": 7})
    base = {k: v.clone() for k, v in module.policy.state_dict().items()}
    actor = {k: v.clone() for k, v in module.noise_actor.state_dict().items()}
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    # warm-up 7 chunk steps = iterations 0 and 1 (6 each) play clipped random noise; only iteration 2 updates:
    # utd 2 x 6 chunk steps = 12 SAC steps x 3 optimizers
    assert module.gradient_steps == 12 and trainer.global_step == 36
    assert module.buffer.size == 3 * 6 * 4 and module.chunk_steps == 18
    warmup = module.buffer.actions[: 2 * 6 * 4]
    assert warmup.abs().max() <= 1.0 and (warmup.abs() == 1.0).any()  # N(0, 1) clipped at 1.5, stored / 1.5
    assert all(torch.equal(v, base[k]) for k, v in module.policy.state_dict().items())
    assert any(not torch.equal(v, actor[k]) for k, v in module.noise_actor.state_dict().items())
    # rewards are stored minus act_steps x reward_offset (2 x 1 per chunk step)
    assert module.last_metrics["rewards/total/mean"] == pytest.approx(
        float(module.buffer.rewards[48:72].mean()) + 2.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------- mmpo fit + resume
def _cli_args(root: Path, *extra: str, config: str = "dsrl_lift.yaml") -> list[str]:
    return ["fit", "-c", str(REPO / "configs" / "robotics" / config), "--trainer.default_root_dir", str(root),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"), *extra]


# per non-warm-up iteration: 3 chunk steps x (utd 1 SAC step x 3 optimizers [+ 1 distillation step for dsrl_na])
@pytest.mark.parametrize(("config", "per_iteration"), [("dsrl_lift.yaml", 9), ("dsrl_na_lift.yaml", 12)])
def test_dsrl_lift_config_fits_and_resumes_bit_exactly(tmp_path, config, per_iteration):
    torch.manual_seed(0)
    bc = FlowBCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, hidden_dims=[8], task="hopper")
    checkpoint = tmp_path / "flow_bc_hopper.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, checkpoint)
    args = ["--model.init_args.bc_checkpoint", str(checkpoint), "--model.init_args.env.task", "hopper",
            "--model.init_args.num_iterations", "3", "--model.init_args.env.num_envs", "2",
            "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "8",
            "--model.init_args.env.asynchronous", "false", "--model.init_args.dsrl.hidden_dims", "[16]",
            "--model.init_args.dsrl.utd", "1", "--model.init_args.dsrl.warmup_chunk_steps", "3",
            "--model.init_args.dsrl.buffer_size", "100", "--model.init_args.optim.minibatch_size", "4",
            "--model.init_args.dsrl.noise_critic_grad_steps", "1",
            "--model.init_args.evaluation.every", "2", "--model.init_args.evaluation.episodes", "2",
            "--trainer.callbacks.init_args.filename", "{step}", "--trainer.callbacks.init_args.every_n_train_steps", "1"]
    main(_cli_args(tmp_path / "full", *args, config=config))
    last = tmp_path / "full" / "checkpoints" / "last.ckpt"
    # iteration 0 is warm-up; iterations 1, 2 take their gradient steps
    assert torch.load(last, weights_only=True)["global_step"] == 2 * per_iteration
    first = tmp_path / "full" / "checkpoints" / f"step={per_iteration}.ckpt"
    assert torch.load(first, weights_only=True)["dppo_state"]["iteration"] == 2
    main(_cli_args(tmp_path / "resumed", *args, "--ckpt_path", str(first), config=config))
    expected = training_state(last)
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["buffer"]["obs"].shape == (3 * 2 * 3, 11)
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])
    # the checkpoint loads as the steered policy (mmpo rollout, evaluate_policy), and does not start a new DSRL run
    steered, metadata = load_policy(last)
    assert isinstance(steered, SteeredPolicy) and metadata["kind"] == "dsrl" and steered.horizon == 2
    module = DSRLModule.load_from_checkpoint(last, env_factory=reach_envs)
    obs = torch.randn(3, 11)
    assert torch.equal(steered.sample(obs).actions, module.steered().sample(obs).actions)
    with pytest.raises(ValueError, match="is a DSRL checkpoint; start DSRL from its BC checkpoint"):
        DSRLModule(str(last), env_factory=reach_envs)
    saved = torch.load(last, weights_only=True)["hyper_parameters"]
    assert saved["dsrl"]["action_magnitude"] == 1.5 and saved["dsrl"]["tau"] == 0.005 and saved["optim"]["lr"] == 3e-4
    aliased = config == "dsrl_na_lift.yaml"
    assert saved["dsrl"]["algorithm"] == ("dsrl_na" if aliased else "dsrl_sac")
    # dsrl_na plays w = tanh(u) in [-1, 1]; its noise critic and optimizer are in the checkpoint (and resumed above)
    assert metadata["dsrl"]["action_magnitude"] == (1.0 if aliased else 1.5)
    assert any(k.startswith("noise_critic.") for k in expected["state_dict"]) == aliased
    assert len(expected["optimizer_states"]) == (4 if aliased else 3)
