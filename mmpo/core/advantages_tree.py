"""Advantage estimators over rollout trees: TreePO's subtree baselines and Segment-PO's MC segment values.

Both are per-token estimators behind the shared registry signature
``fn(rewards (N,), index, *, mask (N, T), ...) -> ((N, T) advantages, metrics)``.

- ``treepo`` (arXiv 2508.17445; official code ``multimodal-art-projection/TreePO``,
  ``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``): each leaf's reward minus the mean
  reward of every subtree holding it, averaged over depths, broadcast to its tokens and whitened
  over the batch's tokens.
- ``segment`` (Segment Policy Optimization, arXiv 2505.23564; official code ``AIFrameResearch/SPO``,
  ``MathEpisodeGeneratorWithMCAdvantages._compute_token_advantages``): the advantage of a segment is
  the Monte Carlo value at its end cut point minus the value at its start cut point; tokens the
  rollout policy gave probability > 0.9 get 0 (the probability mask).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, register_advantage_estimator
from mmpo.core.advantages_verl import _check_per_token
from mmpo.core.groups import GroupIndex
from mmpo.core.masked import masked_whiten

TREE_WEIGHTINGS = ("average", "group_size")

#: Segment-PO's probability threshold (hard-coded 0.9 in the official code)
SEGMENT_PROB_THRESHOLD = 0.9


@register_advantage_estimator(AdvantageEstimator.TREEPO)
def treepo_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    path_ids: Tensor,
    weighting: str = "average",
    skip_zero_std_subgroups: bool = False,
    whiten_eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """TreePO subtree-baseline advantages (per token).

    For each depth d = 0 .. D-1, the subgroup of leaf i is every leaf of the same prompt whose path
    agrees with i's on the first d branch choices (d = 0: the whole prompt group).
    A_{i,d} = R_i - mean(subgroup). Depth 0 always counts; a deeper subgroup counts only when it holds
    more than one leaf (and, with ``skip_zero_std_subgroups``, when its rewards are not all equal).
    ``average``: A_i = mean over the counted depths; ``group_size``: weighted by subgroup size. A_i is
    broadcast to the leaf's tokens and whitened over every masked-in token of the batch
    ((x - mean) / sqrt(var + eps), Bessel var: verl's ``masked_whiten``).

    Args:
        rewards: ``(N,)`` leaf rewards.
        index: prompt groups (the tree roots).
        mask: ``(N, T)`` completion mask.
        path_ids: ``(N, D)`` integer branch choice of the leaf at each depth below the root; a leaf
            that stopped early is padded with -1 (its deeper subgroups are then singletons).
        weighting: ``average`` (the released recipe) or ``group_size`` (paper Eq. 6).
        skip_zero_std_subgroups: the code's ``remove_no_std_subgroup`` (off in the recipe).
        whiten_eps: eps of the whitening.
    """
    if weighting not in TREE_WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; valid: {list(TREE_WEIGHTINGS)}")
    mask = _check_per_token("mask", mask, rewards)
    if path_ids.ndim != 2 or path_ids.shape[0] != rewards.shape[0]:
        raise ValueError(f"path_ids must be (N, D) with N = {rewards.shape[0]}, got shape {tuple(path_ids.shape)}")
    if path_ids.dtype.is_floating_point:
        raise ValueError(f"path_ids must be an integer tensor, got dtype {path_ids.dtype}")
    path_ids = path_ids.to(rewards.device)
    total = torch.zeros_like(rewards)
    weight = torch.zeros_like(rewards)
    levels = torch.zeros_like(rewards)
    # depth 0 = the prompt group; depth d > 0 keys on (prompt, first d branch choices)
    for depth in range(path_ids.shape[1]):
        key = torch.cat([index.inverse.unsqueeze(1), path_ids[:, :depth]], dim=1)
        _, inverse, counts = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
        n = counts.to(rewards.dtype)
        sums = torch.zeros_like(n).index_add(0, inverse, rewards)
        mean = sums / n
        centred = rewards - mean[inverse]
        size = n[inverse]
        counted = size > 1 if depth > 0 else torch.ones_like(size, dtype=torch.bool)
        if skip_zero_std_subgroups and depth > 0:
            sq = torch.zeros_like(n).index_add(0, inverse, centred**2)
            std = torch.sqrt(sq / (n - 1.0).clamp_min(1.0))
            counted &= std[inverse] != 0
        w = size if weighting == "group_size" else torch.ones_like(size)
        total += torch.where(counted, w * centred, torch.zeros_like(centred))
        weight += torch.where(counted, w, torch.zeros_like(w))
        levels += counted.to(rewards.dtype)
    scores = total / weight
    token_scores = scores.unsqueeze(1) * mask
    advantages = masked_whiten(token_scores, mask, eps=whiten_eps) * mask
    return advantages, {"advantages/tree_levels_mean": float(levels.mean())}


def segment_probability_mask(old_log_probs: Tensor, mask: Tensor, threshold: float = SEGMENT_PROB_THRESHOLD) -> Tensor:
    """``(N, T)`` 1 on masked-in tokens whose rollout probability is <= ``threshold`` (Segment-PO's
    probability mask keeps these in the loss; confident tokens, p > threshold, leave it)."""
    return ((old_log_probs.exp() <= threshold) & (mask > 0)).to(mask.dtype)


def segment_cut_points(
    old_log_probs: Tensor, mask: Tensor, *, interval: int = 5, threshold: float = SEGMENT_PROB_THRESHOLD
) -> list[list[int]]:
    """Segment-PO cut points of each row: the position before every ``interval``-th low-probability
    token (p < threshold), as the official code (``np.where(p < 0.9)[0] - 1`` then ``[::interval]``).

    A cut point c means "the state after token c" (c = -1: the prompt alone). The Monte Carlo value of
    that state is estimated from continuations of ``completion[: c + 1]``.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    low = (old_log_probs.exp() < threshold) & (mask > 0)
    return [(torch.nonzero(row).flatten() - 1)[::interval].tolist() for row in low]


@register_advantage_estimator(AdvantageEstimator.SEGMENT)
def segment_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    old_log_probs: Tensor,
    state_values: Tensor,
    prob_threshold: float = SEGMENT_PROB_THRESHOLD,
    whiten: bool = True,
    whiten_eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """Segment-PO (chain) advantages from Monte Carlo values at cut points (per token).

    ``state_values[i, c + 1]`` is V(state after token c) of row i (column 0: the prompt state, cut
    point -1); NaN where no value was estimated. The final token's value is the trajectory reward.
    Walking the row left to right, each token with a value gets A = V - V_previous (0 for the first
    value when there is no prompt value), and every other token takes the advantage of the next
    valued token (its segment's). Tokens the rollout policy gave probability > ``prob_threshold``
    then get 0; with ``whiten``, the remaining tokens are whitened over the batch.

    Args:
        rewards: ``(N,)`` trajectory rewards (the value of the final state).
        index: prompt groups (unused by the formula; kept for the shared signature).
        mask: ``(N, T)`` completion mask (contiguous from position 0).
        old_log_probs: ``(N, T)`` log pi_old of each sampled token.
        state_values: ``(N, T + 1)`` MC values at cut points, NaN elsewhere.
        prob_threshold: confident-token threshold (0.9, hard-coded in the official code).
        whiten: whiten the kept tokens' advantages over the batch (masked tokens are left out of the
            whitening: docs/algorithm_sources.md section 15, Segment-PO).
        whiten_eps: eps of the whitening.
    """
    del index
    mask = _check_per_token("mask", mask, rewards)
    old_log_probs = _check_per_token("old_log_probs", old_log_probs, rewards)
    n, width = mask.shape
    if tuple(state_values.shape) != (n, width + 1):
        raise ValueError(f"state_values must be (N, T + 1) = {(n, width + 1)}, got {tuple(state_values.shape)}")
    values = state_values.detach().to("cpu", torch.float64)
    lengths = mask.sum(-1).long().tolist()
    out = torch.zeros(n, width, dtype=torch.float64)
    num_segments = 0
    for i, length in enumerate(lengths):
        if length == 0:
            continue
        base = values[i, 0].item()
        base = None if math.isnan(base) else base
        row: list[float | None] = [None] * length
        for t in range(length):
            v = float(rewards[i]) if t == length - 1 else values[i, t + 1].item()
            if math.isnan(v):
                continue
            row[t] = 0.0 if base is None else v - base
            base = v
            num_segments += 1
        for t in range(length - 2, -1, -1):  # back-fill: a token takes its segment's (next value's) advantage
            if row[t] is None:
                row[t] = row[t + 1]
        out[i, :length] = torch.tensor(row, dtype=torch.float64)
    out = out.to(device=rewards.device, dtype=rewards.dtype)
    keep = segment_probability_mask(old_log_probs, mask, prob_threshold)
    out = out * keep
    if whiten and float(keep.sum()) >= 2:  # whitening needs two kept tokens; fewer are left as they are
        out = masked_whiten(out, keep, eps=whiten_eps) * keep
    metrics = {
        "advantages/segments_per_sample": num_segments / max(n, 1),
        "advantages/prob_masked_frac": float(1.0 - keep.sum() / mask.sum().clamp_min(1.0)),
    }
    return out, metrics
