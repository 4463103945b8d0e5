"""AHPO: Adaptive Hybrid Policy Optimization (MM-HELIX, arXiv 2510.08540).

GRPO whose prompts may carry an expert trace y*. Per prompt:

1. Roll out G (5) completions and score them as usual.
2. Gate (Eq. 6): xi = 1 when fewer than R_hat (2) of the G rollouts have reward exactly 1.0,
   else 0 (:func:`expert_gate`). Prompts without an expert trace never open the gate (plain
   GRPO). ``static=True`` is "Static-AHPO" (xi = 1 whenever a trace exists).
3. Loss (Eq. 5): L = [ -sum_{gated y*} sum_t log pi(y*_t | x, y*_<t) + sum_on sum_t CLIP_t ] / Z
   with Z = on-policy tokens + gated expert tokens: one token-mean over the union of both
   parts (:func:`hybrid_loss`). The expert NLL is plain SFT (no ratio, no clipping) and the
   trace is not part of the advantage group. No reference KL by default.

Sources: paper section 3.3, App. A.2 (the training code is unreleased; Z follows the LUFFY-style
reading, see ``/work/shared/research/vlm_algos.md`` section 5).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmpo.core.groups import build_group_index


def expert_gate(
    rewards: Tensor,
    group_ids: Tensor,
    has_trace: Tensor,
    *,
    min_successes: int = 2,
    success_value: float = 1.0,
    static: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-prompt gate xi (MM-HELIX, arXiv 2510.08540, Eq. 6).

    Args:
        rewards: ``(N,)`` rollout rewards.
        group_ids: ``(N,)`` prompt id per rollout (any order).
        has_trace: ``(N,)`` bool, the rollout's prompt carries an expert trace.
        min_successes: R_hat; the gate opens when #(reward == success_value) < R_hat.
        success_value: the reward of a fully correct rollout (exact equality, as the paper's 1[R = 1]).
        static: Static-AHPO: the gate is open for every prompt with a trace.

    Returns:
        ``(group_ids_sorted (P,), gate (P,) bool)`` for the P distinct prompts, ids ascending.
    """
    index = build_group_index(group_ids, num_samples=rewards.numel(), min_size=1)
    successes = index.sum((rewards == success_value).to(torch.float32))
    trace = index.amax(has_trace.to(torch.float32)) > 0
    if static:
        gate = trace
    else:
        gate = trace & (successes < min_successes)
    return index.ids, gate


def hybrid_loss(
    on_policy_token_loss: Tensor,
    on_policy_mask: Tensor,
    expert_log_probs: Tensor,
    expert_mask: Tensor,
    expert_gate: Tensor,
    *,
    total_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AHPO's loss over the union of on- and off-policy tokens (arXiv 2510.08540, Eq. 5).

    L = [ sum(on_policy_token_loss * on_mask) + sum(-expert_log_probs * expert_mask * xi) ] / Z,
    Z = sum(on_mask) + sum(expert_mask * xi).

    Args:
        on_policy_token_loss: ``(N, T)`` per-token clipped-surrogate loss of the rollouts.
        on_policy_mask: ``(N, T)`` real rollout tokens.
        expert_log_probs: ``(P, Te)`` log pi(y*_t | x, y*_<t) of the expert traces (with grad).
        expert_mask: ``(P, Te)`` real expert tokens.
        expert_gate: ``(P,)`` xi per trace (bool or 0/1).
        total_tokens: Z over the whole batch when this call sees one micro-batch (gradient
            accumulation); default: this call's own Z.

    Returns:
        ``(loss 0-d, metrics)`` with ``ahpo/off_policy_token_share`` (gated expert tokens / Z).
    """
    on_mask = on_policy_mask.to(on_policy_token_loss.dtype)
    gate = expert_gate.to(expert_log_probs.dtype)[:, None]
    off_mask = expert_mask.to(expert_log_probs.dtype) * gate
    on_tokens = on_mask.sum()
    off_tokens = off_mask.sum()
    z = on_tokens + off_tokens if total_tokens is None else torch.as_tensor(total_tokens, dtype=on_mask.dtype)
    if float(z) <= 0:
        raise ValueError("hybrid_loss: no on-policy or gated expert tokens to normalise over")
    loss = ((on_policy_token_loss * on_mask).sum() + (-expert_log_probs * off_mask).sum()) / z
    metrics = {
        "ahpo/off_policy_token_share": float(off_tokens / (on_tokens + off_tokens).clamp(min=1.0)),
        "ahpo/expert_nll": float((-expert_log_probs.detach() * off_mask).sum() / off_tokens.clamp(min=1.0)),
    }
    return loss, metrics
