"""EPO's entropy-smoothing terms (arXiv 2509.22576; official code ``WujiangXu/EPO``,
``verl/workers/actor/dp_actor.py``: ``generate_entropy_penalty``, ``_calculate_epoch_based_entropy_weight``).

EPO's loss is ``policy - lambda_H * (H - kappa * P)``: an entropy bonus H (token mean) minus a
smoothing penalty P that is ``penalty`` on every token (``token`` mode) or sequence (``seq`` mode)
whose entropy leaves the band (min_ratio * H_hist, max_ratio * H_hist) around the historical mean
entropy H_hist, and 0 inside it. As in the released code P is a constant per token (no gradient
flows through it); the paper's differentiable smoothing term is UNVERIFIED (docs/algorithm_sources.md section 13, EPO).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

from mmpo.core.masked import masked_mean

EPO_MASK_MODES = ("token", "seq")


class EntropyHistory:
    """Running mean of past training steps' token-mean entropies (EPO's H_hist), with a checkpointable state
    (the trainers save it as ``epo_entropy_history``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    @property
    def mean(self) -> float | None:
        """H_hist, or None before the first step (no history: no penalty)."""
        return self.total / self.count if self.count else None

    def update(self, step_mean: float) -> None:
        self.total += step_mean
        self.count += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        self.total, self.count = float(state["total"]), int(state["count"])


def check_epo_settings(
    *, entropy_coef: float, epo_smooth_coef: float, epo_min_ratio: float, epo_max_ratio: float, epo_penalty: float,
    epo_mask_mode: str, epo_phase_epochs: int,
) -> None:
    """Raise ValueError naming the first invalid EPO setting (the trainers' shared setting names)."""
    checks = (
        (entropy_coef > 0, f"EPO needs entropy_coef (lambda_H) > 0, got {entropy_coef}"),
        (epo_smooth_coef >= 0, f"epo_smooth_coef must be >= 0, got {epo_smooth_coef}"),
        (0 <= epo_min_ratio < epo_max_ratio,
         f"EPO needs 0 <= epo_min_ratio < epo_max_ratio, got {epo_min_ratio}, {epo_max_ratio}"),
        (epo_penalty >= 0, f"epo_penalty must be >= 0, got {epo_penalty}"),
        (epo_mask_mode in EPO_MASK_MODES, f"unknown epo_mask_mode {epo_mask_mode!r}; valid: {list(EPO_MASK_MODES)}"),
        (epo_phase_epochs >= 1, f"epo_phase_epochs must be >= 1, got {epo_phase_epochs}"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def epo_smoothing_penalty(
    entropy: Tensor,
    mask: Tensor,
    history_mean: float | None,
    *,
    min_ratio: float = 0.5,
    max_ratio: float = 1.5,
    penalty: float = 0.1,
    mode: str = "token",
) -> tuple[Tensor, Tensor]:
    """EPO's out-of-band penalty P ``(N, T)`` (detached) and the fraction of tokens / sequences in the band.

    Args:
        entropy: ``(N, T)`` per-token policy entropy.
        mask: ``(N, T)`` 1 on completion tokens.
        history_mean: the historical mean entropy H_hist (> 0); None before the first step (no history):
            P = 0 everywhere and ``within_frac`` 1 (the official code has no such case).
        min_ratio, max_ratio: the band (min_ratio * H_hist, max_ratio * H_hist), bounds excluded.
        penalty: P outside the band (the official ``out_range_penalty``).
        mode: ``token`` (each token against the band) or ``seq`` (each sequence's mean entropy;
            the official code averages over all T positions, padding included; here over the
            masked-in tokens, so padding width cannot move a sequence in or out of the band).

    Returns:
        ``(P, within_frac)``: P is 0 in the band and ``penalty`` outside; ``within_frac`` the share
        of masked-in tokens (token mode) or of sequences (seq mode) inside the band.
    """
    if mode not in EPO_MASK_MODES:
        raise ValueError(f"unknown EPO mask mode {mode!r}; valid: {list(EPO_MASK_MODES)}")
    if not 0 <= min_ratio < max_ratio:
        raise ValueError(f"EPO needs 0 <= min_ratio < max_ratio, got {min_ratio}, {max_ratio}")
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    entropy = entropy.detach()
    if history_mean is None:
        return torch.zeros_like(entropy), torch.ones((), dtype=entropy.dtype, device=entropy.device)
    mask = mask.to(entropy.dtype)
    low, high = min_ratio * history_mean, max_ratio * history_mean
    if mode == "token":
        within = (entropy > low) & (entropy < high)
        within_frac = masked_mean(within.to(entropy.dtype), mask)
    else:
        seq_entropy = (entropy * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        seq_within = (seq_entropy > low) & (seq_entropy < high)
        has_tokens = (mask.sum(-1) > 0).to(entropy.dtype)
        within_frac = (seq_within.to(entropy.dtype) * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)
        within = seq_within.unsqueeze(-1).expand_as(entropy)
    penalty_map = torch.where(within, torch.zeros_like(entropy), torch.full_like(entropy, penalty))
    return penalty_map, within_frac


def epo_phase_weight(epoch: int, max_epochs: int = 150) -> float:
    """EPO's optional phase weight on the penalty (official ``_calculate_epoch_based_entropy_weight``).

    e clamped to [0, E], half = E // 2. First half: 1 - 0.2 (1 - exp(-2 e / half)) (1 -> 0.827);
    second half: 0.8 exp(-3 (e - half) / (E - half)) (0.8 -> 0.04). E <= 0 gives 1.
    """
    if max_epochs <= 0:
        return 1.0
    epoch = max(0, min(epoch, max_epochs))
    half = max_epochs // 2
    if epoch <= half:
        return 1.0 if half == 0 else 1.0 - 0.2 * (1.0 - math.exp(-2.0 * epoch / half))
    rest = max_epochs - half
    return 0.8 * math.exp(-3.0 * (epoch - half) / rest)
