"""DPPO's per-(env step, denoising step) PPO quantities (arXiv 2409.00588, ``diffusion_ppo.py``).

Small pure functions, each with a hand-computed unit test; the clipped loss itself and GAE
come from :mod:`mmpo.core`.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def clip_schedule(ft_steps: int, clip_base: float = 1e-3, clip_final: float = 1e-2, rate: float = 3.0) -> torch.Tensor:
    """PPO clip range per fine-tuned denoising step, rising exponentially with i.

    eps_i = clip_base + (clip_final - clip_base) * (exp(rate * u) - 1) / (exp(rate) - 1),
    u = i / (K' - 1), i = 0 (noisiest fine-tuned step) .. K' - 1 (final step).
    K' = 1 is handled explicitly: the single step is the final one, eps = clip_final
    (the official code computes u = 0/0 there, i.e. NaN).

    Returns: (K',) float tensor.
    """
    if ft_steps < 1:
        raise ValueError(f"ft_steps must be >= 1, got {ft_steps}")
    if ft_steps == 1:
        return torch.tensor([clip_final], dtype=torch.float32)
    u = torch.arange(ft_steps, dtype=torch.float64) / (ft_steps - 1)
    if rate == 0:
        ramp = u  # the exponential ramp's limit as rate -> 0
    else:
        ramp = (torch.exp(rate * u) - 1) / (math.exp(rate) - 1)
    return (clip_base + (clip_final - clip_base) * ramp).float()


def denoising_discount(ft_index: torch.Tensor, ft_steps: int, gamma_denoise: float = 0.99) -> torch.Tensor:
    """gamma_denoise ** (K' - 1 - i): 1 at the final step, smaller for noisier steps. (B,) -> (B,)."""
    return gamma_denoise ** (ft_steps - 1 - ft_index).to(torch.float32)


def reduce_step_log_prob(
    elementwise: torch.Tensor, act_steps: int, clamp_min: float = -5.0, clamp_max: float = 2.0
) -> torch.Tensor:
    """Clamp elementwise log-densities, keep the executed chunk prefix, average over (steps, dims).

    (B, Ta, Da) -> (B,). The mean (not sum) makes the PPO ratio a per-dimension geometric mean.
    """
    if not 1 <= act_steps <= elementwise.shape[1]:
        raise ValueError(f"act_steps must be in [1, {elementwise.shape[1]}], got {act_steps}")
    return elementwise.clamp(clamp_min, clamp_max)[:, :act_steps].mean(dim=(1, 2))


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps) over the minibatch (unbiased std, as ``torch.std`` in DPPO)."""
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + eps)


class RunningRewardScaler:
    """Divide rewards by the running std of a per-env discounted return (DPPO ``util/reward_scaling.py``).

    ret_e <- gamma * ret_e * (1 - first_e) + r_e ; var tracked over all envs with Welford/Chan
    parallel updates; scaled r = clip(r / sqrt(var + eps), -clip, clip). The mean is not subtracted.
    """

    def __init__(self, num_envs: int, gamma: float = 0.99, eps: float = 1e-8, clip: float = 10.0) -> None:
        self.gamma, self.eps, self.clip = gamma, eps, clip
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def _update(self, batch: np.ndarray) -> None:
        batch_mean, batch_var, batch_count = float(batch.mean()), float(batch.var()), batch.size
        delta = batch_mean - self.mean
        total = self.count + batch_count
        self.mean += delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var = m2 / total
        self.count = total

    def __call__(self, rewards: np.ndarray, episode_start: np.ndarray) -> np.ndarray:
        """Scale one rollout's rewards.

        rewards (T, N); episode_start (T, N) bool, True where that reward is the first of an episode.
        All T discounted returns update the statistics before any reward is scaled (as DPPO does it).
        """
        rewards = np.asarray(rewards, dtype=np.float64)
        starts = np.asarray(episode_start, dtype=np.float64)
        if rewards.ndim != 2 or rewards.shape != starts.shape or rewards.shape[1] != self.returns.shape[0]:
            raise ValueError(
                f"rewards and episode_start must be (T, {self.returns.shape[0]}), got {rewards.shape} and {starts.shape}"
            )
        returns = np.empty_like(rewards)
        running = self.returns
        for t in range(rewards.shape[0]):
            running = running * self.gamma * (1.0 - starts[t]) + rewards[t]
            returns[t] = running
        self.returns = running
        self._update(returns.reshape(-1))
        return np.clip(rewards / math.sqrt(self.var + self.eps), -self.clip, self.clip)
