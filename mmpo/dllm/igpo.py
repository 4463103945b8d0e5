"""IGPO's pieces as pure functions: trigger, replacement, hint-entropy filter, loss.

IGPO (Inpainting-Guided Policy Optimization, arXiv 2509.10396; ``facebookresearch/igpo``
``trainer_igpo.py``; sources: ``docs/algorithm_sources.md`` section 17, IGPO):

- trigger: a group whose correctness rewards are all 0 (format rewards are ignored);
- the group is regenerated with hints; up to ``max_replacements`` (4 of G = 8) correct
  hinted rollouts, drawn at random, overwrite the *first* k original rollouts;
- advantages r - mean over the mixed group (Dr.GRPO, ``mmpo.core`` ``drgrpo``);
- loss mask: all L completion positions, except hint positions that are not among the
  top ``entropy_keep`` (20%) by old-policy entropy (at least one is kept per sample);
- ratio: token level (``ppo``) or sequence level, PPO clip 0.2, k3 KL x beta (``loss`` / ``kl_kind``
  select any other core loss / KL estimator). The official
  sequence ratio (``use_gspo``) is exp(mean over *all* L positions of l - l_old), broadcast to
  every token and differentiated as a whole, so every position of a kept sequence gets
  gradient, hint tokens dropped by the entropy filter included; the filter then only sets how
  many tokens carry each sequence's loss (``ratio_level="sequence"``). ``"sequence_masked"`` is
  GSPO-token over the loss mask instead: dropped tokens get no gradient at all.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor

from mmpo.core import KL_KINDS, POLICY_LOSSES, Aggregation, LossParts, policy_loss_reads_entropy
from mmpo.training.update import CoreLossSpec, ScoredMicroBatch, core_loss_parts


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
DEFAULT_RATIO_LEVEL = "sequence"
CLIP_SETTINGS = ("clip_low", "clip_high")
DEFAULT_CLIP = 0.2  # IGPO's clip_low = clip_high


def resolve_loss(ratio_level: str = DEFAULT_RATIO_LEVEL, loss: str | None = None) -> str:
    """The core policy loss a (``ratio_level``, ``loss``) pair selects.

    ``loss`` None: ``CORE_LOSS[ratio_level]`` (token -> ``ppo``, sequence -> ``igpo_sequence``,
    sequence_masked -> ``gspo``). ``loss`` set: that registered core loss, and ``ratio_level`` must
    be its default ``"sequence"`` (untouched) or name the same loss; any other pair is a conflict.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if loss is None:
        return CORE_LOSS[ratio_level]
    if loss not in POLICY_LOSSES:
        raise ValueError(f"unknown loss {loss!r}; valid: {POLICY_LOSSES.names()} (or None: chosen by ratio_level)")
    if ratio_level != DEFAULT_RATIO_LEVEL and CORE_LOSS[ratio_level] != loss:
        raise ValueError(
            f"ratio_level {ratio_level!r} selects loss {CORE_LOSS[ratio_level]!r} but loss is {loss!r}: "
            f"set only one of them (ratio_level {DEFAULT_RATIO_LEVEL!r} leaves the choice to loss)"
        )
    return loss


def loss_clip_settings(loss: str, clip_low: float | None, clip_high: float | None) -> dict[str, float]:
    """The clip bounds ``loss`` takes (``clip_low`` / ``clip_high`` of its signature), others and None (the
    loss's own default) left out."""
    params = inspect.signature(POLICY_LOSSES.get(loss)).parameters
    return {name: value for name, value in zip(CLIP_SETTINGS, (clip_low, clip_high))
            if name in params and value is not None}


def check_loss_choice(
    ratio_level: str, loss: str | None, loss_settings: dict[str, Any] | None, clip_low: float | None,
    clip_high: float | None, kl_kind: str, agg: str,
) -> str:
    """The selected core loss, after a dry run on one token so that bad names or settings fail at construction.

    Beyond :func:`resolve_loss`: a loss without clip bounds (sapo, gpg, kl_cov, vespo) refuses
    clip_low / clip_high other than the default 0.2 or None, which it would ignore.
    """
    name = resolve_loss(ratio_level, loss)
    if kl_kind not in KL_KINDS:
        raise ValueError(f"unknown kl_kind {kl_kind!r}; valid: {list(KL_KINDS)}")
    unused = {key: value for key, value in zip(CLIP_SETTINGS, (clip_low, clip_high))
              if value is not None and value != DEFAULT_CLIP and key not in loss_clip_settings(name, clip_low, clip_high)}
    if unused:
        raise ValueError(f"loss {name!r} has no clip bounds: {unused} would be ignored; leave them at {DEFAULT_CLIP} "
                         f"or set the loss's own settings in its settings (loss.settings)")
    if "entropy" in (loss_settings or {}):
        raise ValueError("loss settings 'entropy' is provided by the module (the update-time entropy); remove it")
    one = torch.zeros(1, 1)
    igpo_loss(one, one, None, one[:, 0], torch.ones(1, 1), ratio_level=ratio_level, clip_low=clip_low,
              clip_high=clip_high, beta=0.0, agg=agg, loss=loss, kl_kind=kl_kind, loss_settings=loss_settings,
              entropy=torch.ones(1, 1))
    return name


def igpo_loss_parts(
    log_probs: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    ratio_level: str = DEFAULT_RATIO_LEVEL,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    beta: float = 0.01,
    agg: str = "token-mean",
    loss: str | None = None,
    kl_kind: str = "k3",
    loss_settings: dict[str, Any] | None = None,
    entropy: Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[LossParts, dict[str, Tensor]]:
    """Clipped policy loss + beta * KL (``kl_kind``, default k3) over the (entropy-filtered) loss mask.

    ``ratio_level="token"``: r_t = exp(l_t - l_old_t) (core ``ppo``).
    ``ratio_level="sequence"``: the official run's s_i = exp(mean over all L positions of
    (l_t - l_old_t)), differentiated through s_i (core ``igpo_sequence`` with ``ratio_mask`` all
    positions): hint tokens dropped by the entropy filter still get gradient, the filter only
    reweights (docs/algorithm_sources.md section 17.5).
    ``ratio_level="sequence_masked"``: GSPO-token (core ``gspo``) with s_i averaged over the
    loss mask only: dropped tokens get no gradient.
    ``loss``: any registered core policy loss instead (see :func:`resolve_loss` for how it combines
    with ``ratio_level``); ``igpo_sequence`` always takes its ratio over all L positions, as above.
    ``clip_low`` / ``clip_high`` go to the losses that have clip bounds (None: the loss's default),
    ``loss_settings`` to the loss, ``norm_len`` to ``seq-mean-token-sum-norm`` (None: L),
    ``entropy`` (the update-time per-token entropy, detached here) to a loss that reads it (``hapo``).

    Args:
        log_probs, old_log_probs: ``(batch, L)``.
        ref_log_probs: ``(batch, L)`` reference log-probs, or None when ``beta == 0``.
        advantages: ``(batch,)`` or per token ``(batch, L)``.
        loss_mask: ``(batch, L)``.
        entropy: ``(batch, L)`` per-token entropy of the policy being updated, or None (a loss that
            reads it then fails, naming it).
    Returns:
        ``(parts, metrics)``: the named parts ``policy`` and ``kl`` (coefficient beta) and the core's
        ``policy/*`` metrics.
    """
    name = resolve_loss(ratio_level, loss)
    if kl_kind not in KL_KINDS:
        raise ValueError(f"unknown kl_kind {kl_kind!r}; valid: {list(KL_KINDS)}")
    settings = {**loss_clip_settings(name, clip_low, clip_high), **(loss_settings or {})}
    if name == CORE_LOSS["sequence"]:
        settings.setdefault("ratio_mask", torch.ones_like(log_probs))
    if beta > 0 and ref_log_probs is None:
        raise ValueError("beta > 0 needs ref_log_probs")
    scored = ScoredMicroBatch(
        log_probs, old_log_probs, advantages, loss_mask, ref_log_probs=ref_log_probs if beta > 0 else None,
        loss_entropy=entropy.detach() if entropy is not None and policy_loss_reads_entropy(name) else None,
    )
    # the update engine's parts (policy, kl with coefficient beta), aggregated over this update's loss mask
    return core_loss_parts(scored, CoreLossSpec(name, settings, kl_kind=kl_kind, beta=beta),
                           Aggregation(agg, norm_len=norm_len))


def igpo_loss(log_probs: Tensor, old_log_probs: Tensor, ref_log_probs: Tensor | None, advantages: Tensor,
              loss_mask: Tensor, **settings: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`igpo_loss_parts` summed: ``(loss, metrics)``, the sum of the named parts ``policy`` and ``kl``
    (coefficient beta), logged as ``losses/policy``, ``losses/kl``, plus the core's ``policy/*``; the
    keyword settings are :func:`igpo_loss_parts`'s."""
    parts, metrics = igpo_loss_parts(log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, **settings)
    return parts.total(), {**metrics, **parts.metrics()}
