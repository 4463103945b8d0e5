"""The reverse diffusion chain as a sequence of Gaussian policy steps (DPPO, arXiv 2409.00588).

Every constant comes from a diffusers scheduler (``DDPMScheduler`` with the cosine
``squaredcos_cap_v2`` schedule and epsilon prediction; ``DDIMScheduler`` with "leading"
spacing for DDIM). What no scheduler offers is written here, because DPPO needs the
Gaussian step's *mean and std* separately (to evaluate exact per-step log-probs), while
``scheduler.step`` only returns a sample: the x0 clamp is applied before the mean, and the
std floors of DPPO are applied by the caller (:mod:`mmpo.robotics.policy.diffusion`).
"""

from __future__ import annotations

import torch
from diffusers import DDIMScheduler, DDPMScheduler
from torch import nn

SAMPLERS = ("ddpm", "ddim")


def make_ddpm_scheduler(num_train_steps: int, clip_sample_range: float = 1.0) -> DDPMScheduler:
    """The DDPM scheduler DPPO's schedule matches: cosine betas (cap 0.999), epsilon, x0 clamp."""
    return DDPMScheduler(
        num_train_timesteps=num_train_steps,
        beta_schedule="squaredcos_cap_v2",
        prediction_type="epsilon",
        clip_sample=True,
        clip_sample_range=clip_sample_range,
        variance_type="fixed_small",
    )


def make_ddim_scheduler(num_train_steps: int, clip_sample_range: float = 1.0) -> DDIMScheduler:
    """DDIM over the same betas; "leading" spacing and alpha_prev = 1 at the end, as in DPPO."""
    return DDIMScheduler(
        num_train_timesteps=num_train_steps,
        beta_schedule="squaredcos_cap_v2",
        prediction_type="epsilon",
        clip_sample=True,
        clip_sample_range=clip_sample_range,
        set_alpha_to_one=True,
        timestep_spacing="leading",
    )


class DenoisingSchedule(nn.Module):
    """Per-chain-step coefficients of the reverse process, indexed by chain step ``j``.

    Chain step ``j = 0`` is the noisiest step (timestep ``K-1`` for DDPM) and
    ``j = num_chain_steps - 1`` the final one producing the action. All coefficients are
    buffers of shape (num_chain_steps,), so a batch can mix chain steps (DPPO's
    (env step, denoising step) minibatches).

    Args:
        num_train_steps: K, the number of training diffusion timesteps.
        sampler: "ddpm" (K chain steps) or "ddim" (``ddim_steps`` chain steps).
        ddim_steps: number of DDIM steps (only for sampler="ddim"; default K).
        clip_sample_range: x0 clamp (1.0: actions live in [-1, 1]).
    """

    def __init__(
        self,
        num_train_steps: int = 20,
        *,
        sampler: str = "ddpm",
        ddim_steps: int | None = None,
        clip_sample_range: float = 1.0,
    ) -> None:
        super().__init__()
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if num_train_steps < 1:
            raise ValueError(f"num_train_steps must be >= 1, got {num_train_steps}")
        self.num_train_steps = num_train_steps
        self.sampler = sampler
        self.clip_sample_range = clip_sample_range
        ddpm = make_ddpm_scheduler(num_train_steps, clip_sample_range)
        self.ddpm_scheduler = ddpm
        alphas_cumprod = ddpm.alphas_cumprod.double()
        if sampler == "ddpm":
            timesteps = torch.arange(num_train_steps - 1, -1, -1)
            prev_timesteps = timesteps - 1
            alpha_prev = torch.stack(
                [alphas_cumprod[p] if p >= 0 else torch.tensor(1.0, dtype=torch.float64) for p in prev_timesteps]
            )
            # The scheduler's own posterior variance (beta_tilde, clamped at 1e-20).
            variance = torch.stack([ddpm._get_variance(int(t)).double() for t in timesteps])
        else:
            steps = ddim_steps or num_train_steps
            if not 1 <= steps <= num_train_steps:
                raise ValueError(f"ddim_steps must be in [1, {num_train_steps}], got {steps}")
            ddim = make_ddim_scheduler(num_train_steps, clip_sample_range)
            ddim.set_timesteps(steps)
            self.ddim_scheduler = ddim
            timesteps = ddim.timesteps.clone()
            prev_timesteps = timesteps - num_train_steps // steps
            alpha_prev = torch.stack(
                [alphas_cumprod[p] if p >= 0 else ddim.final_alpha_cumprod.double() for p in prev_timesteps]
            )
            # sigma^2 at eta = 1 (DDIM paper eq. 16), from the scheduler.
            variance = torch.stack([ddim._get_variance(int(t), int(p)).double() for t, p in zip(timesteps, prev_timesteps)])
        alpha_t = alphas_cumprod[timesteps]
        beta_t = 1 - alpha_t / alpha_prev  # "current beta" of the (possibly strided) step
        self.register_buffer("timesteps", timesteps.long(), persistent=False)
        self.register_buffer("alpha_prod", alpha_t.float(), persistent=False)
        self.register_buffer("alpha_prod_prev", alpha_prev.float(), persistent=False)
        # DDPM posterior mean coefficients (Ho et al. eq. 7), as in DDPMScheduler.step.
        self.register_buffer("x0_coef", (alpha_prev.sqrt() * beta_t / (1 - alpha_t)).float(), persistent=False)
        self.register_buffer("xt_coef", ((1 - beta_t).sqrt() * (1 - alpha_prev) / (1 - alpha_t)).float(), persistent=False)
        self.register_buffer("variance", variance.float(), persistent=False)

    @property
    def num_chain_steps(self) -> int:
        return int(self.timesteps.numel())

    def _gather(self, buffer: torch.Tensor, step: torch.Tensor, ndim: int) -> torch.Tensor:
        values = buffer[step]
        return values.view(values.shape + (1,) * (ndim - values.dim()))

    def predict_x0(self, x_t: torch.Tensor, eps_hat: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """x0_hat = (x_t - sqrt(1 - a_t) eps_hat) / sqrt(a_t), clamped to the clip range.

        Shapes: x_t, eps_hat (B, Ta, Da); step (B,) chain-step indices -> (B, Ta, Da).
        """
        a_t = self._gather(self.alpha_prod, step, x_t.dim())
        x0 = (x_t - (1 - a_t).sqrt() * eps_hat) / a_t.sqrt()
        return x0.clamp(-self.clip_sample_range, self.clip_sample_range)

    def mean_std(
        self, x_t: torch.Tensor, eps_hat: torch.Tensor, step: torch.Tensor, *, eta: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std of p(x_prev | x_t) before DPPO's std floors.

        DDPM: mu = c1 x0_hat + c2 x_t, std = sqrt(beta_tilde_t) (the scheduler's posterior).
        DDIM: eps recomputed from the clamped x0_hat, sigma = eta * sqrt(var_t),
        mu = sqrt(a_prev) x0_hat + sqrt(max(0, 1 - a_prev - sigma^2)) eps.

        Shapes: x_t, eps_hat (B, Ta, Da); step (B,) -> mean (B, Ta, Da), std (B, 1, 1).
        """
        x0 = self.predict_x0(x_t, eps_hat, step)
        ndim = x_t.dim()
        variance = self._gather(self.variance, step, ndim)
        if self.sampler == "ddpm":
            mean = self._gather(self.x0_coef, step, ndim) * x0 + self._gather(self.xt_coef, step, ndim) * x_t
            return mean, variance.sqrt()
        a_t = self._gather(self.alpha_prod, step, ndim)
        a_prev = self._gather(self.alpha_prod_prev, step, ndim)
        eps = (x_t - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        sigma = eta * variance.sqrt()
        mean = a_prev.sqrt() * x0 + (1 - a_prev - sigma**2).clamp(min=0).sqrt() * eps
        return mean, sigma

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Forward process q(x_t | x0) via the DDPM scheduler (for the BC epsilon loss)."""
        return self.ddpm_scheduler.add_noise(x0, noise, timesteps)
