"""Reward shaping applied before advantages.

- DAPO soft overlong punishment (arXiv 2503.14476, Eq. 13).
- ReDit reward dithering (arXiv 2506.18631): zero-mean noise on discrete rewards.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor


def overlong_soft_punishment(lengths: Tensor, max_length: int, cache_length: int) -> Tensor:
    """DAPO length penalty R_len, added to the correctness reward (arXiv 2503.14476, Eq. 13).

    R_len(y) = 0 if |y| <= L_max - L_cache;
    ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max; -1 if |y| > L_max.
    DAPO's defaults: L_max = 20480, L_cache = 4096.

    Args:
        lengths: ``(N,)`` response lengths in tokens.
        max_length: L_max.
        cache_length: L_cache, with 0 < L_cache <= L_max.

    Returns:
        ``(N,)`` float penalties in [-1, 0].
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got cache {cache_length}, max {max_length}")
    lengths_f = lengths.to(torch.get_default_dtype())
    start = float(max_length - cache_length)
    ramp = (start - lengths_f) / float(cache_length)
    penalty = torch.where(lengths_f <= start, torch.zeros_like(lengths_f), ramp)
    return torch.where(lengths_f > max_length, torch.full_like(lengths_f, -1.0), penalty)


class DitherDistribution(str, Enum):
    """ReDit noise distributions."""

    UNIFORM = "uniform"
    GAUSSIAN = "gaussian"


def dither_rewards(
    rewards: Tensor,
    *,
    scale: float = 0.05,
    distribution: str | DitherDistribution = "uniform",
    generator: torch.Generator | None = None,
) -> Tensor:
    """ReDit reward dithering (arXiv 2506.18631): r~ = r + noise, noise i.i.d. with zero mean.

    Gives all-equal groups of discrete rewards a non-zero variance while keeping the gradient
    unbiased in expectation. ``uniform``: U(-scale, scale); ``gaussian``: N(0, scale^2). The
    paper's best values are not confirmed by a primary source; 0.05 follows secondary notes.

    Args:
        rewards: ``(N,)``.
        scale: uniform half-width a or Gaussian sigma (>= 0).
        distribution: ``uniform`` or ``gaussian``.
        generator: seeded ``torch.Generator`` (on the rewards' device) for reproducibility.

    Returns:
        ``(N,)`` dithered rewards (float).
    """
    if scale < 0:
        raise ValueError(f"dither scale must be >= 0, got {scale}")
    value = distribution.value if isinstance(distribution, DitherDistribution) else distribution
    dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype()
    shape, device = rewards.shape, rewards.device
    if value == DitherDistribution.UNIFORM.value:
        noise = (torch.rand(shape, generator=generator, dtype=dtype, device=device) * 2.0 - 1.0) * scale
    elif value == DitherDistribution.GAUSSIAN.value:
        noise = torch.randn(shape, generator=generator, dtype=dtype, device=device) * scale
    else:
        raise ValueError(f"unknown dither distribution {distribution!r}; valid: {[d.value for d in DitherDistribution]}")
    return rewards.to(dtype) + noise
