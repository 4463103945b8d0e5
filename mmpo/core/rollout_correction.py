"""Rollout importance-sampling correction: truncated or masked IS weights between the
rollout engine's log-probs and the trainer's.

The engine that samples (HF ``generate`` with a KV cache, vLLM in bf16, ...) and the trainer's
forward pass disagree slightly on log pi of the same tokens, so the samples come from
pi_rollout, not from the pi_old the loss assumes. The weight

    w = pi_old / pi_rollout          (token: per token;  sequence: prod over the completion)

re-weights each token's policy loss (TRL ``vllm_importance_sampling_correction``; verl
``algorithm.rollout_correction.rollout_is``), kept bounded by a cap C:

- ``*_truncate``: w <- clamp(w, cap_low, C)  (truncated IS, "TIS"; verl only has this, with no lower bound)
- ``*_mask``:     w <- 0 where w > C or w < cap_low  (TRL's masked IS; the token / sequence leaves the loss)

Weights are detached (they change the measure, not the objective) and 0 off the mask. They
multiply the per-token policy loss before aggregation (``policy_loss(..., token_weights=w)``),
as TRL's ``per_token_loss * importance_sampling_ratio`` and verl's ``pg_losses * rollout_is_weights``.

Sources: TRL 1.16 ``GRPOTrainer._generate_and_score_completions`` (modes, cap_max default 3.0,
sequence_mask default); verl b178a3cd ``trainer/ppo/rollout_corr_helper.py``
(``compute_rollout_correction_weights``: threshold default 2.0, exp clamp +-20, the ``kl`` /
``k3_kl`` mismatch metrics) and ``core_algos.compute_policy_loss_bypass_mode`` (bypass mode).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mmpo.core.masked import masked_mean

RolloutISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ROLLOUT_IS_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# exp(+-20) bounds the weight before the cap (verl's SAFETY_BOUND): no inf, no overflow in metrics
SAFETY_BOUND = 20.0


def check_rollout_is(mode: str | None, cap: float, cap_low: float | None = None) -> None:
    """Raise ValueError for an unknown mode or a cap that cannot bound a weight."""
    if mode is not None and mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown rollout_is mode {mode!r}; valid: {list(ROLLOUT_IS_MODES)} or None")
    if not cap > 0:
        raise ValueError(f"rollout_is_cap must be > 0, got {cap}")
    if cap_low is not None and not 0 <= cap_low < cap:
        raise ValueError(f"rollout_is_cap_low must be in [0, rollout_is_cap={cap}) or None, got {cap_low}")


def rollout_is_weights(
    trainer_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    mode: RolloutISMode | str,
    *,
    cap: float = 2.0,
    cap_low: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(N, T) detached IS weights pi_trainer / pi_rollout and their metrics.

    Args:
        trainer_log_probs: (N, T) log pi of the sampled tokens under the trainer (the recomputed
            old log-probs; in bypass mode the current policy's, detached).
        rollout_log_probs: (N, T) the same tokens' log-probs as the rollout engine reported them.
        mask: (N, T) 1 on real completion tokens.
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``.
        cap: upper bound C (truncate: clamp at C; mask: zero above C).
        cap_low: optional lower bound (truncate: clamp from below; mask: zero below); None = none.

    Returns:
        ``(weights, metrics)``: weights (N, T), 0 off the mask, sequence modes repeat one weight
        over the sequence's tokens. Metrics (0-d tensors): ``rollout_is/mean``, ``/min``, ``/max`` of
        the final weights (over real tokens, or over non-empty sequences for sequence modes),
        ``rollout_is/clipped_frac`` (share of tokens / sequences whose weight hit a bound:
        truncated or masked), ``rollout_is/kl`` = mean(log pi_rollout - log pi_trainer) and
        ``rollout_is/k3_kl`` = mean(w - 1 - log w) over tokens (verl's ``kl`` / ``k3_kl``),
        ``rollout_is/logp_diff_mean`` / ``_max`` = |log pi_trainer - log pi_rollout| over tokens (TRL's).
    """
    check_rollout_is(mode, cap, cap_low)
    if trainer_log_probs.shape != rollout_log_probs.shape or trainer_log_probs.shape != mask.shape:
        raise ValueError(
            f"trainer_log_probs {tuple(trainer_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)} and mask {tuple(mask.shape)} must have the same (N, T) shape"
        )
    with torch.no_grad():
        dtype = torch.promote_types(trainer_log_probs.dtype, torch.float32)  # bf16 in, fp32 maths; fp64 stays
        trainer = trainer_log_probs.detach().to(dtype)
        rollout = rollout_log_probs.detach().to(dtype)
        maskf = mask.to(dtype)
        valid = maskf > 0
        # a token the engine could not score (NaN) gets ratio 1, as TRL; off-mask entries are 0
        diff = torch.nan_to_num(torch.where(valid, trainer - rollout, torch.zeros_like(trainer)), nan=0.0)
        sequence_level = mode.startswith("sequence")
        log_w = diff.sum(-1, keepdim=True) if sequence_level else diff
        raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        low = cap_low if cap_low is not None else 0.0
        outside = (raw > cap) | (raw < low)
        if mode.endswith("truncate"):
            weights = raw.clamp(min=low, max=cap)
        else:
            weights = raw.masked_fill(outside, 0.0)
        weights = weights.expand_as(trainer) * maskf

        if sequence_level:
            rows = valid.any(-1)
            per_seq, hit = weights.amax(-1)[rows], outside.squeeze(-1)[rows]
            if per_seq.numel() == 0:
                per_seq, hit = torch.zeros(1), torch.zeros(1, dtype=torch.bool)
            w_mean, w_min, w_max = per_seq.mean(), per_seq.min(), per_seq.max()
            clipped = hit.float().mean()
        else:
            w_mean = masked_mean(weights, maskf)
            any_valid = valid.any()
            zero = weights.new_zeros(())
            w_min = torch.where(any_valid, weights.masked_fill(~valid, float("inf")).min(), zero)
            w_max = torch.where(any_valid, weights.masked_fill(~valid, float("-inf")).max(), zero)
            clipped = masked_mean(outside.float(), maskf)
        token_diff = diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        abs_diff = diff.abs() * maskf
        metrics = {
            "rollout_is/mean": w_mean,
            "rollout_is/min": w_min,
            "rollout_is/max": w_max,
            "rollout_is/clipped_frac": clipped,
            "rollout_is/kl": masked_mean(-diff, maskf),
            "rollout_is/k3_kl": masked_mean(torch.expm1(token_diff) - token_diff, maskf),
            "rollout_is/logp_diff_mean": masked_mean(diff.abs(), maskf),
            "rollout_is/logp_diff_max": abs_diff.max() if abs_diff.numel() else abs_diff.new_zeros(()),
        }
    return weights.to(trainer_log_probs.dtype), metrics


def bypass_old_log_probs(rollout_log_probs: Tensor) -> Tensor:
    """verl's bypass mode: the rollout engine's log-probs stand in for the old log-probs.

    The trainer's no-grad old-log-prob pass is skipped (two policies, pi_rollout and pi_theta,
    instead of three): every ratio loss then measures pi_theta / pi_rollout, so its clip also
    bounds the rollout/trainer mismatch and no separate IS weight is applied (verl ``loss_type:
    ppo_clip``). With a ratio-free loss (``gpg``, verl ``loss_type: reinforce``) the IS weight
    pi_theta / pi_rollout is computed from the current (detached) log-probs instead.
    """
    return rollout_log_probs.detach()
