"""Flow-matching policy over action chunks: conditional flow matching BC, K-step Euler sampling, and the two
fine-tuning views of its chain (ReinFlow's noise-injected Markov chain, FPO's flow-matching-loss ratio).

Convention (rectified flow, as ReinFlow's ``model/flow/reflow.py``): time t runs from noise (t = 0, x_0 ~ N(0, I))
to data (t = 1); x_t = t a + (1 - t) x_0, the velocity target is a - x_0, and sampling integrates
x_{i+1} = x_i + v(x_i, i / K) / K for i = 0 .. K-1 (Euler), clamping every state to the action range [-1, 1].

ReinFlow (arXiv 2505.22094, ReinFlow/ReinFlow ``model/flow/ft_ppo/ppoflow.py``, ``model/flow/mlp_flow.py``):
a noise network sigma(s) in [min_std, max_std] turns each Euler step into a Gaussian transition
x_{i+1} ~ N(clamp(x_i + v(x_i, i/K)/K, -1, 1), sigma(s)^2), so the chain x_0 .. x_K has an exact log-likelihood.

FPO (arXiv 2507.21053, akanazawa/fpo ``playground/src/flow_policy/fpo.py``): the likelihood ratio is replaced by
exp(mean_j L_old(tau_j, eps_j) - mean_j L_new(tau_j, eps_j)) with per-sample conditional flow matching losses
L under shared (noise, time) draws.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmpo.robotics.config import FPO_OUTPUT_MODES
from mmpo.robotics.policy.diffusion import BACKBONES, PolicySample
from mmpo.robotics.policy.networks import MLPDenoiser, UNetDenoiser, make_activation

FLOW_FAMILY = "flow"


# ---------------------------------------------------------------------------------------------- formulas
def flow_interpolate(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = t a + (1 - t) x_0. actions, noise (..., Ta, Da); t broadcastable to them (e.g. (B, 1, 1))."""
    return t * actions + (1.0 - t) * noise


def flow_target(actions: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The conditional velocity d x_t / d t = a - x_0."""
    return actions - noise


def euler_times(num_steps: int) -> torch.Tensor:
    """The K Euler step start times i / K, i = 0 .. K-1 (float32, (K,))."""
    if num_steps < 1:
        raise ValueError(f"the flow needs >= 1 Euler step, got {num_steps}")
    return torch.arange(num_steps, dtype=torch.float32) / num_steps


def euler_step(x: torch.Tensor, velocity: torch.Tensor, num_steps: int, action_clip: float | None) -> torch.Tensor:
    """x + v / K, clamped to [-action_clip, action_clip] (None: not clamped)."""
    out = x + velocity / num_steps
    return out if action_clip is None else out.clamp(-action_clip, action_clip)


def bounded_std(raw: torch.Tensor, min_std: float, max_std: float) -> torch.Tensor:
    """ReinFlow's ``ExploreNoiseNet.process_noise``: log sigma^2 = log min^2 + (log max^2 - log min^2) (tanh(raw) + 1) / 2,
    so sigma runs from min_std (raw -> -inf) to max_std (raw -> inf), geometric mean at raw = 0."""
    logvar_min, logvar_max = 2 * math.log(min_std), 2 * math.log(max_std)
    logvar = logvar_min + (logvar_max - logvar_min) * (torch.tanh(raw) + 1) / 2.0
    return torch.exp(0.5 * logvar)


def chain_log_prob(chain: torch.Tensor, means: torch.Tensor, stds: torch.Tensor, *,
                   include_initial: bool = True) -> torch.Tensor:
    """ReinFlow's normalised chain log-likelihood (``PPOFlow.get_logprobs`` with normalize_denoising_horizon and
    normalize_act_space_dimension on, as its agent sets them):

    [log N(x_0; 0, I) + sum_i log N(x_{i+1}; mean_i, diag stds_i^2)] / (K + 1) / (Ta Da)  (without the initial
    term: the transitions' sum / K / (Ta Da)).

    chain (B, K+1, Ta, Da); means, stds (B, K, Ta, Da) -> (B,).
    """
    steps = means.shape[1]
    entries = chain.shape[-2] * chain.shape[-1]
    total = torch.distributions.Normal(means, stds).log_prob(chain[:, 1:]).sum(dim=(1, 2, 3))
    if include_initial:
        total = total + torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0]).sum(dim=(1, 2))
        steps += 1
    return total / steps / entries


def chain_entropy(stds: torch.Tensor, *, include_initial: bool = True) -> torch.Tensor:
    """ReinFlow's entropy-rate estimate of the chain, normalised as :func:`chain_log_prob`: [H(N(0, I)) +
    sum_i H(N(., diag stds_i^2))] / (K + 1) / (Ta Da); H(N(., s^2)) = 0.5 log(2 pi e) + log s per entry.
    stds (B, K, Ta, Da) -> (B,)."""
    batch, steps, horizon, action_dim = stds.shape
    entries = horizon * action_dim
    per_entry = 0.5 * math.log(2 * math.pi * math.e)
    total = (per_entry + stds.log()).sum(dim=(1, 2, 3))
    if include_initial:
        total = total + per_entry * entries
        steps += 1
    return total / steps / entries


def cfm_losses(velocity: torch.Tensor, actions: torch.Tensor, eps: torch.Tensor, tau: torch.Tensor,
               output_mode: str = "u_but_supervise_as_eps") -> torch.Tensor:
    """FPO's per-sample conditional flow matching losses (``FpoState._compute_cfm_loss``), in this module's time
    convention (tau = 1 - t_fpo: tau = 0 noise, tau = 1 data; x_tau = tau a + (1 - tau) eps).

    ``"u"``: mean over (Ta, Da) of (v_pred - (a - eps))^2. ``"u_but_supervise_as_eps"`` (FPO's default): the noise
    is recovered from the predicted velocity, eps_pred = x_tau - tau v_pred, and the loss is mean (eps - eps_pred)^2
    = tau^2 mean (v_pred - (a - eps))^2.

    velocity (B, M, Ta, Da) predicted at x_tau; actions (B, Ta, Da); eps (B, M, Ta, Da); tau (B, M) -> (B, M).
    """
    if output_mode not in FPO_OUTPUT_MODES:
        raise ValueError(f"output_mode must be one of {FPO_OUTPUT_MODES}, got {output_mode!r}")
    a = actions.unsqueeze(1)
    if output_mode == "u":
        return ((velocity - flow_target(a, eps)) ** 2).mean(dim=(-2, -1))
    t = tau[..., None, None]
    eps_pred = flow_interpolate(a, eps, t) - t * velocity
    return ((eps - eps_pred) ** 2).mean(dim=(-2, -1))


# ---------------------------------------------------------------------------------------------- networks
class NoiseNet(nn.Module):
    """ReinFlow's ``ExploreNoiseNet``: an MLP -> raw (Ta Da), then :func:`bounded_std`. Its input is the state
    (``use_time_independent_noise: true``, the official robomimic lift/can/square configs) or, with ``time_dim`` > 0,
    [time features, state] (``use_time_independent_noise: false``, ``learn_explore_time_embedding: false``: the
    velocity network's own time embedding, detached). Shapes: (B, obs_dim) [, (B, time_dim)] -> (B, Ta, Da)."""

    def __init__(self, obs_dim: int, horizon: int, action_dim: int, hidden_dims: Sequence[int], min_std: float,
                 max_std: float, activation: str = "tanh", time_dim: int = 0) -> None:
        super().__init__()
        if not 0 < min_std <= max_std:
            raise ValueError(f"need 0 < min_std <= max_std, got min_std={min_std}, max_std={max_std}")
        self.time_dim = int(time_dim)
        dims = [self.time_dim + obs_dim, *hidden_dims, horizon * action_dim]
        layers: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < len(dims) - 2:
                layers.append(make_activation(activation))
        self.mlp = nn.Sequential(*layers)
        self.horizon, self.action_dim, self.min_std, self.max_std = horizon, action_dim, min_std, max_std

    def forward(self, obs: torch.Tensor, time_features: torch.Tensor | None = None) -> torch.Tensor:
        features = obs if not self.time_dim else torch.cat([time_features, obs], dim=-1)
        raw = self.mlp(features).view(obs.shape[0], self.horizon, self.action_dim)
        return bounded_std(raw, self.min_std, self.max_std)


class FlowActor(nn.Module):
    """What fine-tuning trains: a copy of the velocity network and, for ReinFlow, the noise network."""

    def __init__(self, velocity: nn.Module, noise: NoiseNet | None) -> None:
        super().__init__()
        self.velocity = velocity
        self.noise = noise


# ---------------------------------------------------------------------------------------------- the policy
class FlowPolicy(nn.Module):
    """pi(a_chunk | s) as a K-step Euler integration of a learned velocity field v_theta(x_t, t, s).

    The backbones are the diffusion policy's (residual MLP or diffusers' UNet1DModel), fed the flow time
    t in [0, 1) where the diffusion policy feeds its integer timestep.

    Args:
        obs_dim, action_dim, horizon: as :class:`~mmpo.robotics.policy.DiffusionPolicy`.
        backbone: "mlp" or "unet".
        denoising_steps: K Euler steps (ReinFlow's ``denoising_steps``; robomimic state configs: 4).
        hidden_dims, time_dim, activation, unet_channels: backbone sizes (as the diffusion policy).
        action_clip: every Euler state is clamped to [-action_clip, action_clip] (ReinFlow's act range and
            ``denoised_clip_value``, 1 for min-max normalised actions).
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int,
        *,
        backbone: str = "mlp",
        denoising_steps: int = 4,
        hidden_dims: list[int] | tuple[int, ...] = (512, 512, 512),
        time_dim: int = 16,
        activation: str = "mish",
        unet_channels: list[int] | tuple[int, ...] = (64, 128),
        action_clip: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (("obs_dim", obs_dim), ("action_dim", action_dim), ("horizon", horizon),
                            ("denoising_steps", denoising_steps)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}")
        if action_clip <= 0:
            raise ValueError(f"action_clip must be > 0, got {action_clip}")
        self.policy_config: dict[str, Any] = dict(
            family=FLOW_FAMILY, obs_dim=obs_dim, action_dim=action_dim, horizon=horizon, backbone=backbone,
            denoising_steps=denoising_steps, hidden_dims=list(hidden_dims), time_dim=time_dim, activation=activation,
            unet_channels=list(unet_channels), action_clip=action_clip,
        )
        self.obs_dim, self.action_dim, self.horizon = obs_dim, action_dim, horizon
        self.num_steps, self.action_clip = int(denoising_steps), float(action_clip)
        if backbone == "mlp":
            self.network: nn.Module = MLPDenoiser(obs_dim, action_dim, horizon, hidden_dims=hidden_dims,
                                                  time_dim=time_dim, activation=activation)
        else:
            self.network = UNetDenoiser(obs_dim, action_dim, horizon, channels=unet_channels)
        self.ft_network: FlowActor | None = None
        self.finetune_config: dict[str, Any] | None = None

    @property
    def ft_steps(self) -> int:
        """The PPO update's view (DPPOModule): one ratio per env step once fine-tuning, 0 before."""
        return 0 if self.ft_network is None else 1

    # ------------------------------------------------------------------ fine-tuning
    def enable_finetuning(self, noise: dict[str, Any] | None = None) -> None:
        """Freeze ``network`` and train a copy in ``ft_network`` (every Euler step runs the copy). ``noise``:
        ReinFlow's noise network settings (hidden_dims, min_std, max_std, activation); None: no noise network (FPO)."""
        if self.ft_network is not None:
            raise RuntimeError("fine-tuning is already enabled")
        noise_net = None
        if noise is not None:
            settings = dict(noise)
            time_dim = 0
            if settings.pop("time_conditioned", False):
                if not isinstance(self.network, MLPDenoiser):
                    raise ValueError("a time-conditioned noise network reads the velocity network's time embedding: "
                                     "it needs the mlp backbone")
                time_dim = self.policy_config["time_dim"]
            noise_net = NoiseNet(self.obs_dim, self.horizon, self.action_dim, **settings, time_dim=time_dim)
        self.ft_network = FlowActor(copy.deepcopy(self.network), noise_net)
        self.finetune_config = {"noise": None if noise is None else dict(noise)}
        self.network.requires_grad_(False)
        self.ft_network.requires_grad_(True)

    @property
    def velocity_network(self) -> nn.Module:
        """The network sampling runs: the fine-tuned copy once there is one, else the BC network."""
        return self.network if self.ft_network is None else self.ft_network.velocity

    def velocity(self, x: torch.Tensor, t: torch.Tensor, obs: torch.Tensor, network: nn.Module | None = None) -> torch.Tensor:
        """v(x_t, t, s): x (B, Ta, Da), t (B,) float in [0, 1), obs (B, obs_dim) -> (B, Ta, Da)."""
        return (network or self.velocity_network)(x, t, obs)

    def noise_std(self, obs: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        """ReinFlow's sigma (B, Ta, Da) at ``obs`` and, for a time-conditioned noise network, flow times ``t`` (B,)
        (fed as the fine-tuned velocity network's time embedding, detached, as ReinFlow's ``time_emb.detach()``)."""
        if self.ft_network is None or self.ft_network.noise is None:
            raise RuntimeError("noise_std needs enable_finetuning(noise={...}) first (ReinFlow)")
        noise = self.ft_network.noise
        if not noise.time_dim:
            return noise(obs)
        if t is None:
            raise ValueError("a time-conditioned noise network needs the flow times t")
        velocity = self.ft_network.velocity
        features = velocity.time_embed(velocity.time_proj(t).to(obs.dtype)).detach()
        return noise(obs, features)

    def step_stds(self, obs: torch.Tensor) -> torch.Tensor:
        """sigma of every Euler step (B, K, Ta, Da): the same for all K unless the noise network is time-conditioned."""
        batch, steps = obs.shape[0], self.num_steps
        if not self.ft_network.noise.time_dim:
            return self.noise_std(obs).unsqueeze(1).expand(-1, steps, -1, -1)
        times = euler_times(steps).to(obs.device).repeat(batch)
        stds = self.noise_std(obs.repeat_interleave(steps, dim=0), times)
        return stds.view(batch, steps, self.horizon, self.action_dim)

    # ------------------------------------------------------------------ BC
    def bc_loss(self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Conditional flow matching (rectified flow): t ~ U[0, 1), x_0 ~ N(0, I), MSE(v(x_t, t, s), a - x_0).
        obs (B, obs_dim), actions (B, Ta, Da) -> scalar. Times and noise from ``generator`` or torch's global RNG."""
        self._check_inputs(obs, actions)
        batch = actions.shape[0]
        t = torch.rand(batch, device=actions.device, generator=generator)
        noise = torch.randn(actions.shape, dtype=actions.dtype, device=actions.device, generator=generator)
        x_t = flow_interpolate(actions, noise, t.view(batch, 1, 1))
        return F.mse_loss(self.network(x_t, t, obs), flow_target(actions, noise))

    def _check_inputs(self, obs: torch.Tensor, actions: torch.Tensor | None = None) -> None:
        if obs.dim() != 2 or obs.shape[1] != self.obs_dim:
            raise ValueError(f"obs must have shape (B, {self.obs_dim}), got {tuple(obs.shape)}")
        if actions is not None and tuple(actions.shape[1:]) != (self.horizon, self.action_dim):
            raise ValueError(f"actions must have shape (B, {self.horizon}, {self.action_dim}), got {tuple(actions.shape)}")

    # ------------------------------------------------------------------ sampling
    def draw_chain_noise(self, batch: int, *, generator: torch.Generator | None = None,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The standard-normal draws of one stochastic (ReinFlow) :meth:`sample`: x_0, then one per Euler step."""
        shape = (batch, self.horizon, self.action_dim)
        return [torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(self.num_steps + 1)]

    @torch.no_grad()
    def sample(
        self,
        obs: torch.Tensor,
        *,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
        noise: Sequence[torch.Tensor] | None = None,
        noise_clip: float = 3.0,
        return_log_probs: bool = False,
        include_initial: bool = True,
        initial_noise: torch.Tensor | None = None,
        **_diffusion_only: Any,
    ) -> PolicySample:
        """Euler-integrate from x_0 ~ N(0, I).

        Without a ReinFlow noise network, or ``deterministic``: the plain flow (the chain's means). With one and
        not ``deterministic``: x_{i+1} = mean_i + sigma(s) clip(eps_i, +-noise_clip) (sigma >= min_std, ReinFlow's
        sampling floor ``min_sampling_denoising_std`` being its ``min_std`` in every official config), the last
        state clamped to the action range, as ReinFlow's ``PPOFlow.get_actions``. ``return_log_probs``: the
        chain's :func:`chain_log_prob` (B,) in ``log_probs``. ``noise``: :meth:`draw_chain_noise`'s draws instead of
        drawing them (the plain flow uses only the first, x_0, and also takes a list of x_0 alone). The diffusion samplers' settings (``evaluate_policy`` passes them) do not apply.
        Returns PolicySample(actions (B, Ta, Da), chain (B, K+1, Ta, Da), log_probs (B,) | None).
        """
        self._check_inputs(obs)
        if initial_noise is not None:  # x_0 itself (DSRL steers the plain flow by it)
            if noise is not None:
                raise ValueError("give initial_noise or noise, not both")
            noise = [initial_noise]
        batch, shape = obs.shape[0], (obs.shape[0], self.horizon, self.action_dim)
        stochastic = not deterministic and self.ft_network is not None and self.ft_network.noise is not None
        lengths = (self.num_steps + 1,) if stochastic else (1, self.num_steps + 1)
        if noise is not None and (len(noise) not in lengths or any(tuple(n.shape) != shape for n in noise)):
            raise ValueError(f"noise must be {' or '.join(map(str, lengths))} tensors of shape {shape}")
        drawn = iter(noise) if noise is not None else None

        def randn() -> torch.Tensor:
            if drawn is not None:
                return next(drawn)
            return torch.randn(shape, generator=generator, device=obs.device, dtype=obs.dtype)

        x = randn()
        states, means, stds = [x], [], []
        step_std = self.step_stds(obs) if stochastic else None
        times = euler_times(self.num_steps).to(obs.device)
        for i in range(self.num_steps):
            mean = euler_step(x, self.velocity(x, times[i].expand(batch), obs), self.num_steps, self.action_clip)
            if stochastic:
                std = step_std[:, i]
                x = mean + std * randn().clamp(-noise_clip, noise_clip)
                if i == self.num_steps - 1:
                    x = x.clamp(-self.action_clip, self.action_clip)
                means.append(mean)
                stds.append(std)
            else:
                x = mean
            states.append(x)
        chain = torch.stack(states, dim=1)
        log_probs = None
        if return_log_probs:
            if not stochastic:
                raise ValueError("log-probs need the stochastic ReinFlow chain (a noise network, deterministic=False)")
            log_probs = chain_log_prob(chain, torch.stack(means, 1), torch.stack(stds, 1), include_initial=include_initial)
        return PolicySample(actions=x, chain=chain, log_probs=log_probs)

    # ------------------------------------------------------------------ ReinFlow: re-scoring a stored chain
    def chain_means(self, obs: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        """The Gaussian transitions' means clamp(x_i + v_ft(x_i, i/K)/K) of a stored chain (B, K+1, Ta, Da), all K
        steps in one batched forward of the fine-tuned velocity network -> (B, K, Ta, Da)."""
        batch, steps = chain.shape[0], self.num_steps
        if chain.shape[1] != steps + 1:
            raise ValueError(f"chain must hold K+1 = {steps + 1} states, got {chain.shape[1]}")
        states = chain[:, :-1].reshape(batch * steps, self.horizon, self.action_dim)
        times = euler_times(steps).to(chain.device).repeat(batch)
        velocity = self.velocity(states, times, obs.repeat_interleave(steps, dim=0))
        means = euler_step(states, velocity, steps, self.action_clip)
        return means.view(batch, steps, self.horizon, self.action_dim)

    def chain_log_prob(self, obs: torch.Tensor, chain: torch.Tensor, *, include_initial: bool = True) -> torch.Tensor:
        """ReinFlow log-likelihood (B,) of stored chains under the current fine-tuned networks (gradients flow into
        the velocity copy and the noise network)."""
        means = self.chain_means(obs, chain)
        return chain_log_prob(chain, means, self.step_stds(obs), include_initial=include_initial)

    def chain_entropy(self, obs: torch.Tensor, *, include_initial: bool = True) -> torch.Tensor:
        """ReinFlow's entropy-rate estimate (B,) at ``obs`` (depends on the noise network only; its time input is
        detached)."""
        return chain_entropy(self.step_stds(obs), include_initial=include_initial)

    # ------------------------------------------------------------------ FPO
    def cfm_losses(self, obs: torch.Tensor, actions: torch.Tensor, eps: torch.Tensor, tau: torch.Tensor,
                   output_mode: str = "u_but_supervise_as_eps") -> torch.Tensor:
        """FPO's per-sample CFM losses (:func:`cfm_losses`) under the fine-tuned velocity network (or the BC one
        before fine-tuning). obs (B, obs_dim), actions (B, Ta, Da), eps (B, M, Ta, Da), tau (B, M) -> (B, M)."""
        batch, samples = tau.shape
        x_tau = flow_interpolate(actions.unsqueeze(1), eps, tau[..., None, None])
        velocity = self.velocity(x_tau.reshape(batch * samples, self.horizon, self.action_dim), tau.reshape(-1),
                                 obs.repeat_interleave(samples, dim=0))
        return cfm_losses(velocity.view_as(eps), actions, eps, tau, output_mode)
