"""Group filters applied between rewards and advantages.

- Dynamic sampling (DAPO, arXiv 2503.14476): drop groups whose rewards all agree (they carry
  no group-relative signal).
- GFPO top-k group filtering (arXiv 2508.09726): sample a larger group, keep the k best of
  each group by length (shortest) or by token efficiency (reward / length); advantages are then
  computed on the kept subset only, and rejected samples get no gradient.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor

from mmpo.core.groups import build_group_index


class FilterResult(NamedTuple):
    """Outcome of a group filter.

    Attributes:
        kept_indices: ``(K,)`` int64 positions of the kept samples, ascending.
        keep_mask: ``(N,)`` bool, True for kept samples.
        num_dropped: number of dropped groups (dynamic sampling) or samples (GFPO).
    """

    kept_indices: Tensor
    keep_mask: Tensor
    num_dropped: int


def dynamic_sampling_filter(rewards: Tensor, group_ids: Tensor) -> FilterResult:
    """DAPO dynamic sampling (arXiv 2503.14476): keep only groups whose rewards are not all equal.

    Args:
        rewards: ``(N,)`` scalar rewards (or the filter metric, e.g. accuracy).
        group_ids: ``(N,)`` integer prompt ids, any order; every group needs >= 2 samples.

    Returns:
        :class:`FilterResult` with ``num_dropped`` = number of dropped groups. This function only
        decides; ``GRPOModule`` (``dynamic_sampling: true``) masks the dropped groups out of the loss
        (the batch keeps its size, so DDP ranks stay in step), and refills them with freshly sampled
        groups only when ``dynamic_sampling_retries > 0`` (default 0: masked, not refilled).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    index = build_group_index(group_ids.to(rewards.device), num_samples=rewards.numel())
    constant = index.is_constant(rewards)
    keep_mask = ~constant[index.inverse]
    return FilterResult(
        kept_indices=torch.nonzero(keep_mask).flatten(),
        keep_mask=keep_mask,
        num_dropped=int(constant.sum()),
    )


class GFPOMetric(str, Enum):
    """GFPO ranking metrics."""

    LENGTH = "length"
    REWARD_PER_LENGTH = "reward_per_length"


def gfpo_filter(
    rewards: Tensor,
    lengths: Tensor,
    group_ids: Tensor,
    k: int,
    metric: str | GFPOMetric = "length",
) -> FilterResult:
    """GFPO top-k filter (arXiv 2508.09726): keep the k best samples of every group.

    ``length``: the k shortest responses; ``reward_per_length``: the k highest reward / length.
    Ties keep the earlier batch position. Compute advantages on
    ``rewards[kept_indices]`` with ``group_ids[kept_indices]`` (the subset statistics of GFPO)
    and give rejected samples advantage 0 / mask them out of the loss.

    Args:
        rewards: ``(N,)``.
        lengths: ``(N,)`` response lengths in tokens (> 0).
        group_ids: ``(N,)`` integer prompt ids; every group needs at least k samples.
        k: samples kept per group (2 <= k, so the subset still has group statistics).
        metric: ``length`` or ``reward_per_length``.

    Returns:
        :class:`FilterResult` with ``num_dropped`` = number of dropped samples.
    """
    metric_value = metric.value if isinstance(metric, GFPOMetric) else metric
    valid = [m.value for m in GFPOMetric]
    if metric_value not in valid:
        raise ValueError(f"unknown GFPO metric {metric!r}; valid metrics: {valid}")
    if rewards.ndim != 1 or lengths.shape != rewards.shape:
        raise ValueError(
            f"rewards and lengths must both be (N,), got {tuple(rewards.shape)} and {tuple(lengths.shape)}"
        )
    if k < 2:
        raise ValueError(f"GFPO k must be >= 2 (the kept subset needs group statistics), got {k}")
    if bool((lengths <= 0).any()):
        raise ValueError(f"lengths must be positive; got non-positive at {torch.nonzero(lengths <= 0).flatten().tolist()[:10]}")
    index = build_group_index(group_ids.to(rewards.device), num_samples=rewards.numel(), min_size=k)
    lengths_f = lengths.to(torch.float64)
    if metric_value == GFPOMetric.LENGTH.value:
        score = -lengths_f  # higher is better: shorter
    else:
        score = rewards.to(torch.float64) / lengths_f
    n = rewards.numel()
    positions = torch.arange(n, device=rewards.device)
    # Sort by (group, score descending, position ascending) with two stable sorts.
    order = torch.sort(positions, stable=True).values
    order = order[torch.sort(-score[order], stable=True).indices]
    order = order[torch.sort(index.inverse[order], stable=True).indices]
    group_sorted = index.inverse[order]
    group_start = torch.cumsum(index.counts, 0) - index.counts
    rank_in_group = torch.arange(n, device=rewards.device) - group_start[group_sorted]
    keep_mask = torch.zeros(n, dtype=torch.bool, device=rewards.device)
    keep_mask[order[rank_in_group < k]] = True
    return FilterResult(
        kept_indices=torch.nonzero(keep_mask).flatten(),
        keep_mask=keep_mask,
        num_dropped=int((~keep_mask).sum()),
    )


def lspo_filter(
    lengths: Tensor,
    group_ids: Tensor,
    candidates: Tensor | None = None,
    *,
    low: float = 0.3,
    high: float = 0.65,
    max_quantile: float = 0.95,
) -> FilterResult:
    """LSPO length-aware dynamic sampling (arXiv 2510.01459): keep the shortest and longest length bands.

    For every candidate group (prompt) L(q) = mean response length of its samples; Q(a) is the
    a-quantile (linear interpolation, ``torch.quantile``) of L over the candidate groups of this
    batch. A group is kept iff ``L(q) <= Q(low)`` or ``Q(high) <= L(q) <= Q(max_quantile)``.
    LSPO runs after the zero-variance (accuracy) filter: pass its ``keep_mask`` as ``candidates``;
    groups outside ``candidates`` are dropped and take no part in the quantiles.

    Defaults: the paper's band values are UNVERIFIED (docs/algorithm_sources.md section 9, LSPO); 0.3 / 0.65 / 0.95 are
    this project's reading, and ``max_quantile`` = 1.0 disables the upper cut-off (whose role,
    excluding near-truncated prompts, is also unverified).

    Args:
        lengths: ``(N,)`` response lengths in tokens.
        group_ids: ``(N,)`` integer prompt ids, any order.
        candidates: ``(N,)`` bool, the samples still in play (constant per group); None = all.
        low: quantile of the short band's upper edge, in [0, 1].
        high: quantile of the long band's lower edge, in [low, max_quantile].
        max_quantile: quantile of the long band's upper edge, in [high, 1].

    Returns:
        :class:`FilterResult`; ``num_dropped`` = candidate groups LSPO dropped (not those already
        outside ``candidates``).
    """
    if not 0.0 <= low <= high <= max_quantile <= 1.0:
        raise ValueError(f"LSPO needs 0 <= low <= high <= max_quantile <= 1, got {low}, {high}, {max_quantile}")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D (N,), got shape {tuple(lengths.shape)}")
    index = build_group_index(group_ids.to(lengths.device), num_samples=lengths.numel(), min_size=1)
    mean_length = index.sum(lengths.to(torch.float64)) / index.counts.to(torch.float64)
    if candidates is None:
        candidate_groups = torch.ones_like(mean_length, dtype=torch.bool)
    else:
        if candidates.shape != lengths.shape:
            raise ValueError(f"candidates must be (N,) like lengths, got {tuple(candidates.shape)}")
        candidate_groups = index.sum(candidates.to(torch.float64)) > 0
    keep_groups = torch.zeros_like(candidate_groups)
    if bool(candidate_groups.any()):
        pool = mean_length[candidate_groups]
        q = torch.quantile(pool, torch.tensor([low, high, max_quantile], dtype=pool.dtype, device=pool.device))
        in_band = (mean_length <= q[0]) | ((mean_length >= q[1]) & (mean_length <= q[2]))
        keep_groups = candidate_groups & in_band
    keep_mask = keep_groups[index.inverse]
    return FilterResult(
        kept_indices=torch.nonzero(keep_mask).flatten(),
        keep_mask=keep_mask,
        num_dropped=int((candidate_groups & ~keep_groups).sum()),
    )
