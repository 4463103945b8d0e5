"""DSRL: steering a frozen diffusion or flow policy by SAC in its latent-noise space (arXiv 2506.15799).

The BC policy's weights never change. Its deterministic sampler (a diffusion policy's DDIM eta = 0 chain, a flow
policy's Euler flow) maps the initial noise w to an action chunk, so the env seen through it takes w as its
action: SAC learns pi(w | s), w = m tanh(u) in [-m, m]^(Ta Da), with n critics Q(s, w), their Polyak targets and a
tuned entropy coefficient (ajwagen/dsrl ``algorithm: dsrl_sac``, which runs stable-baselines3's SAC through its
``DiffusionPolicyEnvWrapper``). ``dsrl.algorithm: dsrl_na`` is the noise-aliased variant (the ``DSRL`` class of
the authors' stable-baselines3 fork, ``stable_baselines3/dsrl/dsrl.py``): the buffer holds the executed action chunk
a = pi_base(s, w), a critic Q_A(s, a) learns by the same SAC backup with a' = pi_base(s', w'), a noise critic Q_W(s, w)
is distilled from Q_A on fresh noise w ~ N(0, I) (0.5 sum_k MSE(Q_W,k(s, w), Q_A,k(s, pi_base(s, w)))), and the actor
maximises Q_W; the actor's noise is w = tanh(u) in [-1, 1]^(Ta Da) (the chunked env's action box).

The SAC update, step by step as stable-baselines3's ``SAC.train`` (DLR-RM/stable-baselines3
``stable_baselines3/sac/sac.py``), one optimizer each, through the shared update engine:

1. alpha: loss -(log alpha (log pi(w~|s) + target_entropy).detach()).mean(), w~ ~ pi(.|s) (alpha before this step
   is used below);
2. critics: target y = r + (1 - terminated) gamma (min_k Q'_k(s', w') - alpha log pi(w'|s')), w' ~ pi(.|s'); loss
   0.5 sum_k MSE(Q_k(s, w), y);
3. actor: loss mean(alpha log pi(w~|s) - min_k Q_k(s, w~)) with the just-updated critics;
4. targets: Q' <- (1 - tau) Q' + tau Q.

:class:`DSRLModule` is a :class:`~mmpo.robotics.dppo.DPPOModule` for its env side (vector envs, resets, episode
tracking, pipelined groups, evaluation, checkpoints): each iteration plays ``env.n_steps`` chunk steps, puts the
transitions into the replay buffer, then takes ``utd`` gradient steps per chunk step. The buffer, its sampling
generator and the step counters are checkpointed, so a resume is bit-exact.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from mmpo.robotics.config import DSRLConfig, EnvConfig, EvalConfig, ReturnsConfig
from mmpo.robotics.dppo import DPPOModule, EnvFactory, Rollout
from mmpo.robotics.evaluate import evaluate_policy
from mmpo.robotics.policy.diffusion import DiffusionPolicy, PolicySample
from mmpo.robotics.policy.io import build_policy, load_policy
from mmpo.robotics.reinflow import check_no_chain_eval
from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS
from mmpo.training.update import MicroLoss, UpdateEngine

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # stable-baselines3 sac/policies.py
DSRL_OPTIM = OptimConfig(lr=3e-4, weight_decay=0.0, max_grad_norm=0.0, mu=1, minibatch_size=256)
"""stable-baselines3's SAC as DSRL runs it: Adam lr 3e-4 for actor, critics and alpha, batches of 256, no clipping."""


# ---------------------------------------------------------------------------------------------- SAC formulas
def squashed_log_prob(mean: torch.Tensor, log_std: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log pi(tanh(u)) of a tanh-squashed diagonal Gaussian (stable-baselines3 ``SquashedDiagGaussianDistribution``):
    sum_d [log N(u_d; mean_d, exp(log_std_d)) - log(1 - tanh(u_d)^2 + 1e-6)]. (B, D) -> (B,). The constant scale
    m of w = m tanh(u) is left out, as stable-baselines3 leaves out its action rescaling."""
    normal = torch.distributions.Normal(mean, log_std.exp()).log_prob(u).sum(dim=-1)
    return normal - torch.log(1 - torch.tanh(u) ** 2 + 1e-6).sum(dim=-1)


def critic_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q: torch.Tensor, next_log_prob: torch.Tensor,
                  ent_coef: torch.Tensor | float, gamma: float) -> torch.Tensor:
    """y = r + (1 - terminated) gamma (min_k next_q_k - alpha log pi(w'|s')). rewards, terminated, next_log_prob (B,);
    next_q (B, n) -> (B,)."""
    soft = next_q.min(dim=1).values - ent_coef * next_log_prob
    return rewards + (1.0 - terminated.float()) * gamma * soft


def critic_loss(q_values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """0.5 sum_k mean_b (Q_k - y)^2. q_values (B, n), target (B,)."""
    return 0.5 * ((q_values - target.unsqueeze(1)) ** 2).mean(dim=0).sum()


def actor_loss(log_prob: torch.Tensor, q_values: torch.Tensor, ent_coef: torch.Tensor | float) -> torch.Tensor:
    """mean_b (alpha log pi - min_k Q_k). log_prob (B,), q_values (B, n)."""
    return (ent_coef * log_prob - q_values.min(dim=1).values).mean()


def noise_critic_loss(q_noise: torch.Tensor, q_action: torch.Tensor) -> torch.Tensor:
    """DSRL-NA's distillation loss 0.5 sum_k mean_b (Q_W,k(s, w) - Q_A,k(s, pi_base(s, w)))^2, critic k onto critic k,
    the action critic's values detached. q_noise, q_action (B, n)."""
    return 0.5 * ((q_noise - q_action.detach()) ** 2).mean(dim=0).sum()


def ent_coef_loss(log_ent_coef: torch.Tensor, log_prob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """-mean_b log alpha (log pi + target_entropy), the log-prob detached (stable-baselines3's form of arXiv
    1812.05905's temperature loss, on log alpha)."""
    return -(log_ent_coef * (log_prob + target_entropy).detach()).mean()


@torch.no_grad()
def polyak_update(params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], tau: float) -> None:
    """target <- (1 - tau) target + tau param (stable-baselines3 ``polyak_update``)."""
    for param, target in zip(params, targets):
        target.mul_(1 - tau).add_(param, alpha=tau)


# ---------------------------------------------------------------------------------------------- networks
def tanh_mlp(in_dim: int, hidden_dims: Sequence[int], out_dim: int | None, layer_norm: bool) -> nn.Sequential:
    """[Linear -> LayerNorm (``layer_norm``) -> Tanh] per hidden width, then Linear(out_dim) unless None (DSRL's
    stable-baselines3 ``net_arch`` with ``post_linear_modules=[LayerNorm]`` and ``activation_fn=Tanh``)."""
    layers: list[nn.Module] = []
    width = in_dim
    for hidden in hidden_dims:
        layers.append(nn.Linear(width, hidden))
        if layer_norm:
            layers.append(nn.LayerNorm(hidden))
        layers.append(nn.Tanh())
        width = hidden
    if out_dim is not None:
        layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


class NoiseActor(nn.Module):
    """pi(u | s) = N(mean(s), exp(log_std(s))^2) over the flattened noise (Ta Da), log_std clamped to [-20, 2]
    (stable-baselines3 SAC ``Actor``; ``log_std_init`` only applies to gSDE)."""

    def __init__(self, obs_dim: int, noise_dim: int, hidden_dims: Sequence[int], layer_norm: bool) -> None:
        super().__init__()
        self.latent = tanh_mlp(obs_dim, hidden_dims, None, layer_norm)
        self.mu = nn.Linear(hidden_dims[-1], noise_dim)
        self.log_std = nn.Linear(hidden_dims[-1], noise_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.latent(obs)
        return self.mu(latent), self.log_std(latent).clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs: torch.Tensor, generator: torch.Generator | None = None,
               deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tanh(u) (B, D) in [-1, 1], log pi (B,)); deterministic: tanh(mean) and its log-prob."""
        mean, log_std = self(obs)
        u = mean if deterministic else mean + log_std.exp() * torch.randn(
            mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return torch.tanh(u), squashed_log_prob(mean, log_std, u)


class QEnsemble(nn.Module):
    """n critics Q_k(s, a) = MLP([s, a]) -> (B, n) (stable-baselines3 ``ContinuousCritic``)."""

    def __init__(self, obs_dim: int, noise_dim: int, hidden_dims: Sequence[int], layer_norm: bool, n: int) -> None:
        super().__init__()
        self.q = nn.ModuleList(tanh_mlp(obs_dim + noise_dim, hidden_dims, 1, layer_norm) for _ in range(n))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        features = torch.cat([obs, actions], dim=-1)
        return torch.cat([q(features) for q in self.q], dim=1)


class ReplayBuffer:
    """Transitions (s, a in [-1, 1]^D, r, s', terminated) in preallocated tensors, the oldest overwritten once full;
    uniform sampling with replacement from a seeded generator (stable-baselines3 ``ReplayBuffer.sample``)."""

    FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated")

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, seed: int = 0) -> None:
        self.capacity = int(capacity)
        self.obs = torch.zeros(self.capacity, obs_dim)
        self.actions = torch.zeros(self.capacity, action_dim)
        self.rewards = torch.zeros(self.capacity)
        self.next_obs = torch.zeros(self.capacity, obs_dim)
        self.terminated = torch.zeros(self.capacity)
        self.position, self.size = 0, 0
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor, next_obs: torch.Tensor,
            terminated: torch.Tensor) -> None:
        """Append a batch of transitions (rows of each tensor), in order: the last ``capacity`` of them when more."""
        rows = obs.shape[0]
        keep = min(rows, self.capacity)
        index = (self.position + rows - keep + torch.arange(keep)) % self.capacity
        for name, value in zip(self.FIELDS, (obs, actions, rewards, next_obs, terminated)):
            getattr(self, name)[index] = value[rows - keep:].to(getattr(self, name).dtype)
        self.position = (self.position + rows) % self.capacity
        self.size = min(self.size + rows, self.capacity)

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        if self.size == 0:
            raise RuntimeError("the replay buffer is empty")
        index = torch.randint(0, self.size, (batch_size,), generator=self.generator)
        return {name: getattr(self, name)[index] for name in self.FIELDS}

    def state_dict(self) -> dict[str, Any]:
        return {**{name: getattr(self, name)[: self.size].clone() for name in self.FIELDS},
                "position": self.position, "size": self.size, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity:
            raise ValueError(f"the saved replay buffer holds {size} transitions, more than buffer_size={self.capacity}")
        for name in self.FIELDS:
            getattr(self, name)[:size] = state[name]
        self.position, self.size = int(state["position"]), size
        self.generator.set_state(state["generator"])


class SteeredPolicy(nn.Module):
    """A frozen policy steered by a noise actor: ``sample(obs)`` plays the frozen deterministic chain from
    w = m tanh(u), u the actor's mean (``deterministic``) or a draw. What ``evaluate_policy`` and ``mmpo rollout``
    take (``load_policy`` returns one for a DSRL checkpoint). Shapes: obs (B, obs_dim) -> actions (B, Ta, Da)."""

    def __init__(self, base: nn.Module, actor: NoiseActor, action_magnitude: float) -> None:
        super().__init__()
        self.base, self.actor, self.action_magnitude = base, actor, float(action_magnitude)
        self.obs_dim, self.action_dim, self.horizon = base.obs_dim, base.action_dim, base.horizon

    @torch.no_grad()
    def steer(self, obs: torch.Tensor, squashed: torch.Tensor) -> torch.Tensor:
        """The frozen policy's deterministic chunk (B, Ta, Da) from the noise w = m squashed (B, Ta Da): a diffusion
        policy's DDIM eta = 0 chain from x_K = w, a flow policy's Euler flow from x_0 = w."""
        noise = (self.action_magnitude * squashed).view(-1, self.horizon, self.action_dim)
        sampler = "ddim" if isinstance(self.base, DiffusionPolicy) else None
        return self.base.sample(obs, deterministic=True, deterministic_sampler=sampler, initial_noise=noise).actions

    @torch.no_grad()
    def sample(self, obs: torch.Tensor, *, deterministic: bool = True, generator: torch.Generator | None = None,
               **_chain_settings: Any) -> PolicySample:
        squashed, _ = self.actor.sample(obs, generator=generator, deterministic=deterministic)
        return PolicySample(actions=self.steer(obs, squashed), chain=None)


def build_steered_policy(metadata: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> SteeredPolicy:
    """A DSRL checkpoint's :class:`SteeredPolicy` from its metadata and full ``state_dict`` (``policy.*`` the frozen
    policy, ``noise_actor.*`` the actor)."""
    from mmpo.robotics.policy.io import build_policy

    settings = metadata["dsrl"]
    base = build_policy(metadata, {k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")})
    actor = NoiseActor(base.obs_dim, base.horizon * base.action_dim, settings["hidden_dims"], settings["layer_norm"])
    actor.load_state_dict({k[len("noise_actor."):]: v for k, v in state_dict.items() if k.startswith("noise_actor.")})
    return SteeredPolicy(base, actor, settings["action_magnitude"]).eval()


class DSRLModule(DPPOModule):
    """DSRL (noise-action SAC, or the noise-aliased variant with ``dsrl.algorithm: dsrl_na``) on a frozen BC
    diffusion or flow policy.

    Args:
        bc_checkpoint: a diffusion BC / DPPO or flow BC / ReinFlow / FPO checkpoint; its policy is frozen.
        num_iterations: iterations; each plays ``env.n_steps`` chunk steps on ``env.num_envs`` envs and then takes
            ``dsrl.utd`` x ``env.n_steps`` gradient steps (none while the buffer is still in its warm-up).
        dsrl: the SAC settings (:class:`~mmpo.robotics.config.DSRLConfig`).
        env: as DPPO (DSRL's robomimic envs: 4; 75 chunk steps = one 300-step Lift episode per iteration).
            ``reset_at_iteration`` (default true) starts each iteration from freshly seeded envs, which makes a resume
            bit-exact; false keeps episodes running across iterations (the official loop) but a resumed run restarts
            them.
        optim: Adam lr (3e-4, actor, critics and alpha) and the batch size ``minibatch_size`` (256); no clipping.
        evaluation, seed, env_factory, max_consecutive_skips: as :class:`~mmpo.robotics.dppo.DPPOModule`; evaluation
            plays the actor's mean noise w = m tanh(mean(s)).
    """

    config_groups = ("env", "optim", "evaluation", "dsrl")
    flat_names: dict[str, tuple[str, str]] = {}
    kind = "dsrl"

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 100,
        *,
        dsrl: DSRLConfig = DSRLConfig(),
        env: EnvConfig = EnvConfig(num_envs=4, n_steps=75),
        optim: OptimConfig = DSRL_OPTIM,
        evaluation: EvalConfig = EvalConfig(),
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.dsrl = as_config(dsrl, DSRLConfig())
        optim = as_config(optim, DSRL_OPTIM)
        evaluation = as_config(evaluation, EvalConfig())
        check_no_chain_eval(evaluation, "DSRL")
        super().__init__(bc_checkpoint, num_iterations, env=env, returns=ReturnsConfig(reward_scale_running=False),
                         optim=optim, critic=CriticConfig(lr=optim.lr, warmup_iterations=0), evaluation=evaluation,
                         seed=seed, env_factory=env_factory, max_consecutive_skips=max_consecutive_skips)
        for name in ("chain", "returns", "loss", "critic"):
            self.hparams.pop(name, None)  # DPPO groups DSRL does not take
        settings, policy = self.dsrl, self.policy
        self.noise_dim = policy.horizon * policy.action_dim
        self.noise_actor = NoiseActor(policy.obs_dim, self.noise_dim, settings.hidden_dims, settings.layer_norm)
        # dsrl_sac: Q(s, w); dsrl_na: Q_A(s, a) on the flattened chunk (Ta Da, the noise's size) and Q_W(s, w)
        self.aliased = settings.algorithm == "dsrl_na"
        self.noise_magnitude = 1.0 if self.aliased else settings.action_magnitude
        self.critic = QEnsemble(policy.obs_dim, self.noise_dim, settings.hidden_dims, settings.layer_norm,
                                settings.n_critics)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.noise_critic = QEnsemble(policy.obs_dim, self.noise_dim, settings.hidden_dims, settings.layer_norm,
                                      settings.n_critics) if self.aliased else None
        self.log_ent_coef = nn.Parameter(torch.full((1,), math.log(settings.init_ent_coef)),
                                         requires_grad=settings.learn_ent_coef)
        self.target_entropy = float(-self.noise_dim if settings.target_entropy is None else settings.target_entropy)
        self.buffer = ReplayBuffer(settings.buffer_size, policy.obs_dim, self.noise_dim, seed=seed + 1)
        self.chunk_steps = 0  # vector-env chunk steps played (the warm-up counts them)
        self.gradient_steps = 0
        self.update_engine = UpdateEngine(self, max_grad_norm=self.optim.max_grad_norm)

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[Any, dict[str, Any]]:
        policy, metadata = load_policy(bc_checkpoint)
        if metadata.get("kind") == "dsrl":
            raise ValueError(f"{bc_checkpoint} is a DSRL checkpoint; start DSRL from its BC checkpoint (resume a DSRL "
                             "run with --ckpt_path)")
        steps = self.dsrl.ddim_steps
        if isinstance(policy, DiffusionPolicy) and steps is not None and policy.policy_config["sampler"] == "ddpm":
            if policy.ft_network is not None:
                raise ValueError(f"{bc_checkpoint} is a DPPO-fine-tuned diffusion policy; steer its own chain with "
                                 "dsrl.ddim_steps: null")
            # the same eps network on a DDIM chain of ``steps`` strided timesteps (ajwagen/dsrl: use_ddim, ddim_steps 8)
            config = {**policy.policy_config, "sampler": "ddim", "ddim_steps": steps}
            policy = build_policy({**metadata, "policy_config": config, "ft_steps": 0}, policy.state_dict())
        policy.requires_grad_(False)
        return policy.eval(), metadata

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        lr = self.optim.lr
        optimizers = [torch.optim.Adam(self.noise_actor.parameters(), lr=lr),
                      torch.optim.Adam(self.critic.parameters(), lr=lr)]
        if self.dsrl.learn_ent_coef:
            optimizers.append(torch.optim.Adam([self.log_ent_coef], lr=lr))
        if self.noise_critic is not None:  # last: dsrl_na's noise critic (its own SACPolicy's critic optimizer)
            optimizers.append(torch.optim.Adam(self.noise_critic.parameters(), lr=lr))
        return optimizers

    # ------------------------------------------------------------------ acting through the frozen policy
    def steered(self) -> SteeredPolicy:
        """The frozen policy steered by the noise actor (built on call: it holds no weights of its own)."""
        return SteeredPolicy(self.policy, self.noise_actor, self.noise_magnitude)

    def steer(self, obs: torch.Tensor, squashed: torch.Tensor) -> torch.Tensor:
        """:meth:`SteeredPolicy.steer` of this module's frozen policy."""
        return self.steered().steer(obs, squashed)

    def draw_step_noise(self, batch: int) -> None:
        """None: each env group's :meth:`act` draws its own noise."""
        return None

    def warming_up(self) -> bool:
        """Whether this iteration's rollout still plays random noise: it starts before ``warmup_chunk_steps``
        chunk steps were played (the warm-up is counted in whole iterations)."""
        return self.chunk_steps < self.dsrl.warmup_chunk_steps

    def act(self, obs: torch.Tensor, noise: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunks (N, Ta, Da), what the buffer stores (N, Ta Da) and zeros (N, 1). dsrl_sac stores the played squashed
        noise tanh(u); during its warm-up w ~ N(0, I) clipped to [-m, m], stored as w / m. dsrl_na stores the chunk
        itself; its warm-up noise is N(0, I) unclipped (ajwagen/dsrl ``utils.py`` ``collect_rollouts``)."""
        generator = self._sampling_generator()
        magnitude = self.dsrl.action_magnitude
        if self.warming_up():
            draw = torch.randn((obs.shape[0], self.noise_dim), generator=generator, device=obs.device)
            squashed = draw if self.aliased else draw.clamp(-magnitude, magnitude) / magnitude
        else:
            squashed, _ = self.noise_actor.sample(obs, generator=generator)
        chunks = self.steer(obs, squashed)
        stored = chunks.reshape(obs.shape[0], -1) if self.aliased else squashed
        return chunks, stored, torch.zeros(obs.shape[0], 1, device=obs.device)

    def collect_rollout(self) -> Rollout:
        rollout = super().collect_rollout()
        self.chunk_steps += self.env.n_steps
        return rollout

    # ------------------------------------------------------------------ replay and SAC
    def compute_advantages(self, rollout: Rollout) -> Rollout:
        """Put the rollout's transitions into the replay buffer (reward - act_steps x reward_offset per chunk step;
        terminations stop the backup, time-limit truncations do not, s' = the final obs at an episode's end)."""
        steps, envs = rollout.rewards.shape
        rewards = rollout.rewards - self.act_steps * self.dsrl.reward_offset
        self.buffer.add(rollout.obs.reshape(steps * envs, -1), rollout.chains.reshape(steps * envs, -1),
                        rewards.reshape(-1), rollout.reached_obs.reshape(steps * envs, -1),
                        rollout.terminated.reshape(-1))
        return rollout

    def sac_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One SAC gradient step on ``batch`` (stable-baselines3's order: alpha, critics, actor, targets)."""
        optimizers = self.optimizers()
        actor_opt, critic_opt = optimizers[0], optimizers[1]
        obs, next_obs = batch["obs"], batch["next_obs"]
        generator = self._sampling_generator()
        metrics: dict[str, float] = {}
        actions_pi, log_prob = self.noise_actor.sample(obs, generator=generator)
        if self.dsrl.learn_ent_coef:
            def alpha_loss(_: None) -> MicroLoss:
                loss = ent_coef_loss(self.log_ent_coef, log_prob, self.target_entropy)
                return MicroLoss(loss, {"losses/ent_coef": float(loss.detach())})
            ent_coef = self.log_ent_coef.detach().exp()  # before its step, as stable-baselines3
            metrics.update(self.update_engine.optimizer_step([None], alpha_loss, stepped=[optimizers[2]]).metrics)
        else:
            ent_coef = self.log_ent_coef.detach().exp()
        with torch.no_grad():
            next_actions, next_log_prob = self.noise_actor.sample(next_obs, generator=generator)
            if self.aliased:  # Q_A's backup on the frozen policy's chunk for the next noise
                next_actions = self.steer(next_obs, next_actions).reshape(next_obs.shape[0], -1)
            target = critic_target(batch["rewards"], batch["terminated"], self.critic_target(next_obs, next_actions),
                                   next_log_prob, ent_coef, self.dsrl.gamma)

        def q_loss(_: None) -> MicroLoss:
            loss = critic_loss(self.critic(obs, batch["actions"]), target)
            return MicroLoss(loss, {"losses/critic": float(loss.detach())})

        metrics.update({k: v for k, v in self.update_engine.optimizer_step([None], q_loss, stepped=[critic_opt]).metrics.items()
                        if k != "policy/grad_norm"})

        actor_critic = self.noise_critic if self.aliased else self.critic  # dsrl_na: the distilled Q_W(s, w)

        def pi_loss(_: None) -> MicroLoss:
            loss = actor_loss(log_prob, actor_critic(obs, actions_pi), ent_coef)
            return MicroLoss(loss, {"losses/actor": float(loss.detach())})

        metrics.update(self.update_engine.optimizer_step([None], pi_loss, stepped=[actor_opt]).metrics)
        polyak_update(list(self.critic.parameters()), list(self.critic_target.parameters()), self.dsrl.tau)
        self.gradient_steps += 1
        metrics["policy/ent_coef"] = float(ent_coef)
        metrics["policy/log_prob"] = float(log_prob.detach().mean())
        return metrics

    def distill_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """dsrl_na: one step of the noise critic towards the action critic on w ~ N(0, I) (unclipped) and the frozen
        policy's chunk for it (``DSRL.update_noise_critic``)."""
        obs = batch["obs"]
        with torch.no_grad():
            noise = torch.randn((obs.shape[0], self.noise_dim), generator=self._sampling_generator(), device=obs.device)
            q_action = self.critic(obs, self.steer(obs, noise).reshape(obs.shape[0], -1))

        def loss_fn(_: None) -> MicroLoss:
            loss = noise_critic_loss(self.noise_critic(obs, noise), q_action)
            return MicroLoss(loss, {"losses/noise_critic": float(loss.detach())})

        metrics = self.update_engine.optimizer_step([None], loss_fn, stepped=[self.optimizers()[-1]]).metrics
        return {k: v for k, v in metrics.items() if k != "policy/grad_norm"}

    def ppo_update(self, rollout: Rollout, train_actor: bool) -> dict[str, float]:
        """``utd`` SAC steps per chunk step of the rollout (dsrl_na: each ``utd`` followed by
        ``noise_critic_grad_steps`` distillation steps, the official ``train`` call per env step); none after a warm-up
        rollout (the official code starts training once its random-noise steps are in the buffer, after the actor's
        first step)."""
        played_warmup = self.chunk_steps - self.env.n_steps < self.dsrl.warmup_chunk_steps  # the rollout just played
        if played_warmup or self.buffer.size < 1:
            return {"perf/buffer_size": float(self.buffer.size), "perf/gradient_steps": float(self.gradient_steps)}
        self.noise_actor.train()
        history = []
        for _ in range(self.env.n_steps):
            for _ in range(self.dsrl.utd):
                history.append(self.sac_step(self._batch()))
            for _ in range(self.dsrl.noise_critic_grad_steps if self.aliased else 0):
                history.append(self.distill_step(self._batch()))
        self.noise_actor.eval()
        keys = dict.fromkeys(key for step in history for key in step)
        metrics = {key: float(np.mean([step[key] for step in history if key in step])) for key in keys}
        metrics.update({"perf/buffer_size": float(self.buffer.size), "perf/gradient_steps": float(self.gradient_steps)})
        return metrics

    def _batch(self) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in self.buffer.sample(self.optim.minibatch_size).items()}

    # ------------------------------------------------------------------ evaluation and checkpoints
    def evaluate(self, num_episodes: int | None = None) -> dict[str, float]:
        seed = self.hparams.seed + 10_000 + self.iteration
        self._collect_prefetched_reset()
        result = evaluate_policy(self.steered(), self.envs, num_episodes or self.evaluation.episodes, deterministic=True,
                                 seed=seed, generator=torch.Generator(device=self.device).manual_seed(seed))
        self._obs = None
        return result

    def robotics_metadata(self) -> dict[str, Any]:
        settings = self.dsrl
        return {**super().robotics_metadata(), "kind": self.kind, "ft_steps": self.policy.ft_steps,
                "flow_finetune": getattr(self.policy, "finetune_config", None),
                "dsrl": {"hidden_dims": list(settings.hidden_dims), "layer_norm": settings.layer_norm,
                         "action_magnitude": self.noise_magnitude, "algorithm": settings.algorithm}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["dppo_state"].update(buffer=self.buffer.state_dict(), chunk_steps=self.chunk_steps,
                                        gradient_steps=self.gradient_steps)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("dppo_state", {})
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])
            self.chunk_steps, self.gradient_steps = int(state["chunk_steps"]), int(state["gradient_steps"])
