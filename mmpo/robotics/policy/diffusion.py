"""Diffusion policy over action chunks with exact per-denoising-step Gaussian log-probs.

DDPM (Ho et al., arXiv 2006.11239) / DDIM (arXiv 2010.02502) sampling from diffusers
schedulers; the DPPO (arXiv 2409.00588) view of the chain as a Gaussian policy: a frozen
base network for the first K - K' chain steps and a fine-tuned copy for the last K',
sampling-std floor, noise clip and log-prob std floor.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmpo.robotics.policy.networks import EncodedDenoiser, ImageEncoder, MLPDenoiser, UNetDenoiser
from mmpo.robotics.policy.schedule import DenoisingSchedule

BACKBONES = ("mlp", "unet")


@dataclass
class PolicySample:
    """actions (B, Ta, Da) in normalised space; chain (B, K'+1, Ta, Da): the states entering the
    K' fine-tuned steps plus the final action (None when no fine-tuned copy exists)."""

    actions: torch.Tensor
    chain: torch.Tensor | None
    log_probs: torch.Tensor | None = None  # (B, K', Ta, Da) elementwise, when requested


class DiffusionPolicy(nn.Module):
    """pi(a_chunk | s) as a K-step reverse diffusion with an epsilon-predicting backbone.

    Args:
        obs_dim: flattened (normalised) observation size.
        action_dim: Da.
        horizon: Ta, predicted chunk length.
        backbone: "mlp" (residual MLP, DPPO default for states) or "unet" (diffusers UNet1DModel).
        denoising_steps: K (training timesteps of the DDPM scheduler).
        sampler: "ddpm" (K chain steps) or "ddim" (``ddim_steps`` chain steps).
        ddim_steps: DDIM chain length (sampler="ddim").
        hidden_dims, time_dim, activation: residual-MLP sizes (DPPO lift/can: [512]*3, 16, mish).
        unet_channels: UNet channel levels (DPPO: 64, 128).
        image_encoder: for a camera task's observation [proprio; image flattened (H, W, C)]: the
            :class:`~mmpo.robotics.policy.networks.ImageEncoder` settings (``image_size``, optional ``channels``,
            ``feature_dim``); the backbone is conditioned on its features. None: state observations.
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int,
        *,
        backbone: str = "mlp",
        denoising_steps: int = 20,
        sampler: str = "ddpm",
        ddim_steps: int | None = None,
        hidden_dims: list[int] | tuple[int, ...] = (512, 512, 512),
        time_dim: int = 16,
        activation: str = "mish",
        unet_channels: list[int] | tuple[int, ...] = (64, 128),
        image_encoder: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("obs_dim", obs_dim), ("action_dim", action_dim), ("horizon", horizon)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}")
        self.policy_config: dict[str, Any] = dict(
            obs_dim=obs_dim, action_dim=action_dim, horizon=horizon, backbone=backbone,
            denoising_steps=denoising_steps, sampler=sampler, ddim_steps=ddim_steps,
            hidden_dims=list(hidden_dims), time_dim=time_dim, activation=activation,
            unet_channels=list(unet_channels),
        )
        if image_encoder:
            self.policy_config["image_encoder"] = dict(image_encoder)
        self.obs_dim, self.action_dim, self.horizon = obs_dim, action_dim, horizon
        encoder = ImageEncoder(obs_dim, **image_encoder) if image_encoder else None
        cond_dim = encoder.out_dim if encoder is not None else obs_dim
        if backbone == "mlp":
            self.network: nn.Module = MLPDenoiser(
                cond_dim, action_dim, horizon, hidden_dims=hidden_dims, time_dim=time_dim, activation=activation
            )
        else:
            self.network = UNetDenoiser(cond_dim, action_dim, horizon, channels=unet_channels)
        if encoder is not None:
            self.network = EncodedDenoiser(encoder, self.network)
        self.schedule = DenoisingSchedule(denoising_steps, sampler=sampler, ddim_steps=ddim_steps)
        self.ft_network: nn.Module | None = None
        self.ft_steps = 0
        self._ddim_twin: DenoisingSchedule | None = None

    def deterministic_schedule(self, sampler: str | None) -> DenoisingSchedule:
        """Schedule for deterministic sampling: the policy's own (None / its sampler name), or for a DDPM
        policy ``"ddim"``: DDIM with eta = 0 over the same K timesteps (same chain steps, so the same
        frozen/fine-tuned network split) -- the probability-flow-like deterministic sampler."""
        if sampler is None or sampler == self.schedule.sampler:
            return self.schedule
        if sampler != "ddim":
            raise ValueError(f"deterministic sampler must be 'ddpm' or 'ddim', got {sampler!r}")
        if self._ddim_twin is None:
            twin = DenoisingSchedule(self.schedule.num_train_steps, sampler="ddim",
                                     ddim_steps=self.schedule.num_chain_steps)
            self._ddim_twin = twin.to(self.schedule.timesteps.device)
        return self._ddim_twin

    # ------------------------------------------------------------------ fine-tuning split
    def enable_finetuning(self, ft_steps: int) -> None:
        """Freeze ``network`` (base) and train a deep copy ``ft_network`` on the last K' chain steps."""
        num_chain = self.schedule.num_chain_steps
        if not 1 <= ft_steps <= num_chain:
            raise ValueError(f"ft_steps (K') must be in [1, {num_chain}], got {ft_steps}")
        if self.ft_network is None:
            self.ft_network = copy.deepcopy(self.network)
        self.ft_steps = ft_steps
        self.network.requires_grad_(False)
        self.ft_network.requires_grad_(True)

    @property
    def first_ft_step(self) -> int:
        """Chain index of the first fine-tuned step (num_chain_steps when not fine-tuning)."""
        return self.schedule.num_chain_steps - self.ft_steps

    def _network_for(self, chain_step: int) -> nn.Module:
        if self.ft_network is not None and chain_step >= self.first_ft_step:
            return self.ft_network
        return self.network

    # ------------------------------------------------------------------ BC
    def bc_loss(
        self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Epsilon-prediction MSE (DDPM simple loss). obs (B, obs_dim), actions (B, Ta, Da) -> scalar.

        Timesteps and noise come from ``generator`` (on ``actions``' device) or torch's global RNG.
        """
        self._check_inputs(obs, actions)
        batch = actions.shape[0]
        timesteps = torch.randint(
            0, self.schedule.num_train_steps, (batch,), device=actions.device, generator=generator
        )
        noise = torch.randn(actions.shape, dtype=actions.dtype, device=actions.device, generator=generator)
        noisy = self.schedule.add_noise(actions, noise, timesteps)
        return F.mse_loss(self.network(noisy, timesteps, obs), noise)

    def _check_inputs(self, obs: torch.Tensor, actions: torch.Tensor | None = None) -> None:
        if obs.dim() != 2 or obs.shape[1] != self.obs_dim:
            raise ValueError(f"obs must have shape (B, {self.obs_dim}), got {tuple(obs.shape)}")
        if actions is not None and tuple(actions.shape[1:]) != (self.horizon, self.action_dim):
            raise ValueError(
                f"actions must have shape (B, {self.horizon}, {self.action_dim}), got {tuple(actions.shape)}"
            )

    # ------------------------------------------------------------------ one Gaussian step
    def step_distribution(
        self,
        network: nn.Module,
        x_t: torch.Tensor,
        chain_step: torch.Tensor,
        obs: torch.Tensor,
        *,
        eta: float = 1.0,
        schedule: DenoisingSchedule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean (B, Ta, Da) and raw std (B, 1, 1) of p(x_prev | x_t, s) at chain steps (B,)."""
        schedule = schedule or self.schedule
        timesteps = schedule.timesteps[chain_step]
        eps_hat = network(x_t, timesteps, obs)
        return schedule.mean_std(x_t, eps_hat, chain_step, eta=eta)

    # ------------------------------------------------------------------ sampling
    def draw_chain_noise(
        self, batch: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> list[torch.Tensor]:
        """The standard-normal draws of one stochastic :meth:`sample` call on ``batch`` rows, in its order
        (x_K, then one per chain step): ``sample(obs, generator=g)`` equals ``sample(obs,
        noise=draw_chain_noise(len(obs), generator=g))``, and rows of the draws can be handed to sub-batches."""
        shape = (batch, self.horizon, self.action_dim)
        return [torch.randn(shape, generator=generator, device=device, dtype=dtype)
                for _ in range(self.schedule.num_chain_steps + 1)]

    @torch.no_grad()
    def sample(
        self,
        obs: torch.Tensor,
        *,
        deterministic: bool = False,
        min_sampling_std: float = 0.1,
        noise_clip: float = 3.0,
        eta: float = 1.0,
        generator: torch.Generator | None = None,
        return_log_probs: bool = False,
        min_logprob_std: float = 0.1,
        deterministic_sampler: str | None = None,
        ddpm_eval_std_floor: float | None = None,
        noise: Sequence[torch.Tensor] | None = None,
        initial_noise: torch.Tensor | None = None,
    ) -> PolicySample:
        """Run the reverse chain from x ~ N(0, I).

        Stochastic (training rollouts): std floored at ``min_sampling_std`` on every step (frozen and
        fine-tuned), standard-normal noise clipped to +-``noise_clip``. Deterministic (evaluation):
        the mean of every step (DDPM) / DDIM with eta = 0; the fine-tuned copy still runs the last K'
        steps, so evaluation uses exactly the training-time networks. ``return_log_probs`` records the
        elementwise log-density of each fine-tuned transition under N(mean, max(std, min_logprob_std)^2),
        i.e. the value :meth:`chain_step_log_prob` recomputes later. ``deterministic_sampler="ddim"``
        makes a DDPM policy's deterministic chain DDIM with eta = 0 over the same timesteps (default:
        the mean of each DDPM step). ``ddpm_eval_std_floor`` (deterministic DDPM chains only): None takes the
        mean of every step; a float f is the official DPPO evaluation (``model/diffusion/diffusion.py``, f = 1e-3):
        every step but the last adds noise with std max(std, f) (noise clipped to +-``noise_clip``).
        ``noise`` (stochastic chains only): the standard-normal draws to use instead of drawing them, as
        :meth:`draw_chain_noise` returns them (one (B, Ta, Da) tensor for x_K, then one per chain step); rows
        of a larger batch's draws give each row exactly the chain that batch would have given it.
        ``initial_noise`` (B, Ta, Da): x_K itself instead of a draw (DSRL steers a deterministic chain by it).
        Shapes: obs (B, obs_dim) -> PolicySample(actions (B, Ta, Da), chain (B, K'+1, Ta, Da) | None).
        """
        self._check_inputs(obs)
        batch = obs.shape[0]
        shape = (batch, self.horizon, self.action_dim)
        if noise is not None:
            if deterministic:
                raise ValueError("noise is for stochastic chains; a deterministic chain draws only x_K")
            if len(noise) != self.schedule.num_chain_steps + 1 or any(tuple(n.shape) != shape for n in noise):
                raise ValueError(f"noise must be {self.schedule.num_chain_steps + 1} tensors of shape {shape}")
        drawn = iter(noise) if noise is not None else None

        def randn() -> torch.Tensor:
            if drawn is not None:
                return next(drawn)
            return torch.randn(shape, generator=generator, device=obs.device, dtype=obs.dtype)

        if initial_noise is not None and (noise is not None or tuple(initial_noise.shape) != shape):
            raise ValueError(f"initial_noise must be one tensor of shape {shape}, without noise")
        x = initial_noise if initial_noise is not None else randn()
        chain: list[torch.Tensor] = []
        log_probs: list[torch.Tensor] = []
        num_chain = self.schedule.num_chain_steps
        step_eta = 0.0 if deterministic else eta
        schedule = self.deterministic_schedule(deterministic_sampler) if deterministic else self.schedule
        for j in range(num_chain):
            if self.ft_network is not None and j >= self.first_ft_step:
                chain.append(x)
            steps = torch.full((batch,), j, dtype=torch.long, device=obs.device)
            mean, std = self.step_distribution(self._network_for(j), x, steps, obs, eta=step_eta, schedule=schedule)
            if deterministic:
                if ddpm_eval_std_floor is None or schedule.sampler != "ddpm" or j == num_chain - 1:
                    x = mean
                else:
                    eval_noise = torch.randn(shape, generator=generator, device=obs.device, dtype=obs.dtype)
                    x = mean + std.clamp(min=ddpm_eval_std_floor) * eval_noise.clamp(-noise_clip, noise_clip)
                continue
            step_noise = randn()
            x_next = mean + std.clamp(min=min_sampling_std) * step_noise.clamp(-noise_clip, noise_clip)
            if return_log_probs and self.ft_network is not None and j >= self.first_ft_step:
                logprob_std = std.clamp(min=min_logprob_std).expand_as(mean)
                log_probs.append(torch.distributions.Normal(mean, logprob_std).log_prob(x_next))
            x = x_next
        if self.ft_network is not None:
            chain.append(x)
            stacked = torch.stack(log_probs, dim=1) if log_probs else None
            return PolicySample(actions=x, chain=torch.stack(chain, dim=1), log_probs=stacked)
        return PolicySample(actions=x, chain=None)

    # ------------------------------------------------------------------ log-probs (DPPO)
    def chain_step_log_prob(
        self,
        obs: torch.Tensor,
        chain: torch.Tensor,
        ft_index: torch.Tensor,
        *,
        min_logprob_std: float = 0.1,
        eta: float = 1.0,
    ) -> torch.Tensor:
        """Elementwise log N(x_{i+1}; mu_ft(x_i), max(sigma, floor)^2) of fine-tuned step i.

        Args:
            obs: (B, obs_dim).
            chain: (B, K'+1, Ta, Da) stored chains.
            ft_index: (B,) fine-tuned step index i in [0, K'-1] (0 = noisiest fine-tuned step).
        Returns:
            (B, Ta, Da) elementwise log-densities (gradients flow into ``ft_network``).
        """
        if self.ft_network is None:
            raise RuntimeError("chain_step_log_prob needs enable_finetuning(ft_steps) first")
        if chain.shape[1] != self.ft_steps + 1:
            raise ValueError(f"chain must hold K'+1 = {self.ft_steps + 1} states, got {chain.shape[1]}")
        rows = torch.arange(chain.shape[0], device=chain.device)
        x_t = chain[rows, ft_index]
        x_prev = chain[rows, ft_index + 1]
        mean, std = self.step_distribution(self.ft_network, x_t, ft_index + self.first_ft_step, obs, eta=eta)
        std = std.clamp(min=min_logprob_std).expand_as(mean)
        return torch.distributions.Normal(mean, std).log_prob(x_prev)
