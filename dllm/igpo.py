"""IGPO's pieces as pure functions: trigger, replacement, hint-entropy filter, loss.

IGPO (Inpainting-Guided Policy Optimization, arXiv 2509.10396; ``facebookresearch/igpo``
``trainer_igpo.py``; digest ``research/dllm_dppo.md`` 1.4):

- trigger: a group whose correctness rewards are all 0 (format rewards are ignored);
- the group is regenerated with hints; up to ``max_replacements`` (4 of G = 8) correct
  hinted rollouts, drawn at random, overwrite the *first* k original rollouts;
- advantages r - mean over the mixed group (Dr.GRPO, ``mmpo.core`` ``drgrpo``);
- loss mask: all L completion positions, except hint positions that are not among the
  top ``entropy_keep`` (20%) by old-policy entropy (at least one is kept per sample);
- ratio: token level (``ppo``) or sequence level, PPO clip 0.2, k3 KL x beta. The official
  sequence ratio (``use_gspo``) is exp(mean over *all* L positions of l - l_old), broadcast to
  every token and differentiated as a whole, so every position of a kept sequence gets
  gradient, hint tokens dropped by the entropy filter included; the filter then only sets how
  many tokens carry each sequence's loss (``ratio_level="sequence"``). ``"sequence_masked"`` is
  GSPO-token over the loss mask instead: dropped tokens get no gradient at all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmpo.core import LossParts, aggregate, kl_penalty, policy_loss


def all_wrong_groups(correct: Tensor, group_ids: Tensor) -> Tensor:
    """Group ids whose rollouts are all wrong.

    Args:
        correct: ``(N,)`` bool, correctness of each rollout.
        group_ids: ``(N,)`` prompt id of each rollout.
    Returns:
        ``(num_all_wrong,)`` sorted group ids.
    """
    if correct.shape != group_ids.shape:
        raise ValueError(f"correct shape {tuple(correct.shape)} != group_ids shape {tuple(group_ids.shape)}")
    ids = torch.unique(group_ids)
    keep = [int(g) for g in ids if not bool(correct[group_ids == g].any())]
    return torch.tensor(keep, dtype=group_ids.dtype)


def choose_replacements(
    hinted_correct: Tensor, max_replacements: int, generator: torch.Generator | None = None
) -> list[tuple[int, int]]:
    """Which hinted rollouts replace which originals in one all-wrong group.

    Up to ``max_replacements`` correct hinted rollouts are drawn at random (without
    replacement) and overwrite original rollouts 0, 1, ..., k-1 (official code).

    Args:
        hinted_correct: ``(G,)`` bool, correctness of the hinted rollouts.
        max_replacements: cap k (official: 4 of G = 8, i.e. at most half the group).
    Returns:
        ``[(original_index, hinted_index), ...]`` of length ``min(max_replacements, #correct)``.
    """
    if max_replacements < 0:
        raise ValueError(f"max_replacements must be >= 0, got {max_replacements}")
    correct_idx = torch.nonzero(hinted_correct, as_tuple=True)[0]
    if correct_idx.numel() == 0 or max_replacements == 0:
        return []
    order = torch.randperm(correct_idx.numel(), generator=generator)
    chosen = correct_idx[order[: min(max_replacements, correct_idx.numel())]]
    return [(slot, int(h)) for slot, h in enumerate(chosen.tolist())]


def hint_entropy_filter(hint_mask: Tensor, entropy: Tensor, keep_fraction: float = 0.2) -> Tensor:
    """Loss mask that keeps only the highest-entropy hint tokens.

    Per row with n hint positions, keep the top ``max(1, floor(keep_fraction * n))`` hint
    positions by old-policy entropy; every non-hint position is kept (IGPO code fact).

    Args:
        hint_mask: ``(batch, L)`` True at hint positions.
        entropy: ``(batch, L)`` old-policy entropy at each position.
        keep_fraction: IGPO's ``entropy_clipping_ratio_inpaint`` (0.2).
    Returns:
        ``(batch, L)`` bool loss mask.
    """
    if hint_mask.shape != entropy.shape:
        raise ValueError(f"hint_mask shape {tuple(hint_mask.shape)} != entropy shape {tuple(entropy.shape)}")
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    keep = ~hint_mask.bool()
    for row in range(hint_mask.shape[0]):
        positions = torch.nonzero(hint_mask[row], as_tuple=True)[0]
        if positions.numel() == 0:
            continue
        k = max(1, math.floor(keep_fraction * positions.numel()))
        top = torch.topk(entropy[row, positions].float(), k).indices
        keep[row, positions[top]] = True
    return keep


RATIO_LEVELS = ("token", "sequence", "sequence_masked")
# ratio_level -> the core policy loss that implements it
CORE_LOSS = {"token": "ppo", "sequence": "igpo_sequence", "sequence_masked": "gspo"}


def igpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    ratio_level: str = "sequence",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.01,
    agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy loss + beta * k3 KL over the (entropy-filtered) loss mask.

    ``ratio_level="token"``: r_t = exp(l_t - l_old_t) (core ``ppo``).
    ``ratio_level="sequence"``: the official run's s_i = exp(mean over all L positions of
    (l_t - l_old_t)), differentiated through s_i (core ``igpo_sequence`` with ``ratio_mask`` all
    positions): hint tokens dropped by the entropy filter still get gradient, the filter only
    reweights (digest 1.4.5).
    ``ratio_level="sequence_masked"``: GSPO-token (core ``gspo``) with s_i averaged over the
    loss mask only: dropped tokens get no gradient.

    Args:
        log_probs, old_log_probs: ``(batch, L)``.
        ref_log_probs: ``(batch, L)`` reference log-probs, or None when ``beta == 0``.
        advantages: ``(batch,)``.
        loss_mask: ``(batch, L)``.
    Returns:
        ``(loss, metrics)``: the sum of the named parts ``policy`` and ``kl`` (coefficient beta),
        logged as ``losses/policy``, ``losses/kl``, plus the core's ``policy/*``.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    settings = {"ratio_mask": torch.ones_like(log_probs)} if ratio_level == "sequence" else {}
    pg_loss, metrics = policy_loss(
        CORE_LOSS[ratio_level], log_probs, old_log_probs, advantages, loss_mask, agg=agg,
        clip_low=clip_low, clip_high=clip_high, **settings,
    )
    parts = LossParts().add("policy", pg_loss)
    if beta > 0:
        if ref_log_probs is None:
            raise ValueError("beta > 0 needs ref_log_probs")
        kl = aggregate(kl_penalty(log_probs, ref_log_probs.detach(), "k3"), loss_mask.to(log_probs.dtype), agg)
        parts.add("kl", kl, coef=beta)
    return parts.total(), {**metrics, **parts.metrics()}
