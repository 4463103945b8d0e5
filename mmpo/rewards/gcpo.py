"""GCPO's rewards and group contrastive mask (GeometryZero, arXiv 2506.07160).

Per rollout o_i of a prompt group:

- R_acc in {0, 1}: answer correctness (the ``accuracy`` reward).
- R_fmt in {0, 0.5}: think/answer format (the ``format`` reward, weight 0.5).
- R_aux in {0, 0.5}: the rollout uses an auxiliary construction. The detector is pluggable
  (:data:`AUX_DETECTORS`); the default looks for a non-empty ``<auxiliary>...</auxiliary>``
  block (the authors' v2 detector; their later one executes diagram code, which needs a
  sandbox we do not ship).
- R_len = scale * min(T, cap) / cap with T the completion's token count (0.5, 900).

Group contrastive masking (:func:`group_contrastive_mask`): acc_aux / acc_no are the mean R_acc
of the group's rollouts with / without auxiliary construction; M = +1 if acc_aux - acc_no > eps,
-1 if acc_no - acc_aux > eps, else 0, and 0 when either side is empty (eps 0.05). The total
R = R_acc + R_fmt + M * R_aux + R_len is then group-normalised like GRPO.

Sources: paper Eq. 3-4; authors' workspace ``ekonwang/r1_workspace:workspace/reward/reward_utils.py``
(v2 tag detector, length reward v9/v10); docs/algorithm_sources.md section 4.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import Tensor

from mmpo.core.groups import build_group_index
from mmpo.rewards.answers import tag_blocks


AuxDetector = Callable[[str], bool]


def detect_auxiliary_tag(completion: str) -> bool:
    """True when the completion has a non-empty ``<auxiliary>...</auxiliary>`` block."""
    return any(body.strip() for body in tag_blocks(completion, "<auxiliary>", "</auxiliary>"))


def detect_auxiliary_keywords(completion: str) -> bool:
    """A tag-free detector: the reasoning says it constructs/draws/extends a line or point."""
    return bool(
        re.search(r"\b(construct|draw|extend)\w*\b.{0,40}\b(line|segment|point|perpendicular|parallel)",
                  completion, flags=re.IGNORECASE | re.DOTALL)
    )


AUX_DETECTORS: dict[str, AuxDetector] = {
    "tag": detect_auxiliary_tag,
    "keywords": detect_auxiliary_keywords,
}


def get_aux_detector(name: str) -> AuxDetector:
    """Look up a detector by name (:data:`AUX_DETECTORS`) or a ``module:function`` path."""
    if name in AUX_DETECTORS:
        return AUX_DETECTORS[name]
    if ":" in name:
        import importlib

        module_name, function_name = name.split(":", 1)
        return getattr(importlib.import_module(module_name), function_name)
    raise ValueError(f"unknown auxiliary detector {name!r}; valid names: {sorted(AUX_DETECTORS)} or 'module:function'")


def uses_auxiliary(completions: list[str], detector: AuxDetector = detect_auxiliary_tag) -> Tensor:
    """``(N,)`` bool: which completions use an auxiliary construction."""
    return torch.tensor([bool(detector(c)) for c in completions], dtype=torch.bool)


def gcpo_length_reward(num_tokens: Tensor, *, cap: int = 900, scale: float = 0.5) -> Tensor:
    """R_len = scale * min(T, cap) / cap (GeometryZero dev code v9/v10: scale 0.5, cap 900).

    Args:
        num_tokens: ``(N,)`` completion lengths in tokens.
        cap: length at which the reward saturates.
        scale: reward at or above ``cap``.

    Returns:
        ``(N,)`` float32.
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    return scale * num_tokens.to(torch.float32).clamp(min=0, max=cap) / cap


def group_contrastive_mask(
    accuracy: Tensor, uses_aux: Tensor, group_ids: Tensor, *, eps: float = 0.05
) -> tuple[Tensor, dict[str, float]]:
    """GCPO's per-prompt mask M in {-1, 0, +1} (GeometryZero, arXiv 2506.07160, Eq. 4).

    Args:
        accuracy: ``(N,)`` R_acc in {0, 1}.
        uses_aux: ``(N,)`` bool, auxiliary construction detected.
        group_ids: ``(N,)`` prompt ids (any order).
        eps: margin on the accuracy gap (paper 0.05).

    Returns:
        ``(mask (N,) float32, metrics)``: each rollout gets its group's M; metrics give the
        fraction of groups with M = +1 / -1 / 0 and with an empty side.
    """
    index = build_group_index(group_ids, num_samples=accuracy.numel())
    aux = uses_aux.to(torch.float32)
    acc = accuracy.to(torch.float32)
    aux_count = index.sum(aux)
    no_count = index.counts.to(torch.float32) - aux_count
    acc_aux = index.sum(acc * aux) / aux_count.clamp(min=1.0)
    acc_no = index.sum(acc * (1.0 - aux)) / no_count.clamp(min=1.0)
    gap = acc_aux - acc_no
    group_mask = torch.zeros_like(gap)
    group_mask[gap > eps] = 1.0
    group_mask[-gap > eps] = -1.0
    one_side_empty = (aux_count == 0) | (no_count == 0)
    group_mask[one_side_empty] = 0.0
    num_groups = float(index.num_groups)
    metrics = {
        "gcpo/mask_pos_frac": float((group_mask == 1).sum()) / num_groups,
        "gcpo/mask_neg_frac": float((group_mask == -1).sum()) / num_groups,
        "gcpo/mask_zero_frac": float((group_mask == 0).sum()) / num_groups,
        "gcpo/one_side_empty_frac": float(one_side_empty.sum()) / num_groups,
        "gcpo/aux_rollout_frac": float(aux.mean()),
    }
    return group_mask[index.inverse], metrics


def gcpo_total_reward(
    accuracy: Tensor, format_reward: Tensor, aux_reward: Tensor, length: Tensor, mask: Tensor
) -> Tensor:
    """R = R_acc + R_fmt + M * R_aux + R_len, all ``(N,)`` already scaled (R_fmt, R_aux in {0, 0.5})."""
    return accuracy + format_reward + mask * aux_reward + length
