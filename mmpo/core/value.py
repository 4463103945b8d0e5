"""Token-level PPO with a learned critic: GAE over completion tokens, the clipped value loss, and the
classic RLHF reward (the outcome on the last token, minus a KL penalty on every token).

Pure torch, written against verl's ``core_algos.py`` (commit b178a3cd): ``compute_gae_advantage_return``
(itself adapted from TRL's PPO trainer) and ``compute_value_loss`` (TRL's ``ppo_trainer.py`` value loss);
tests/core/test_value.py checks parity with both on the same inputs and hand values.

All tensors are ``(N, T)`` over completion positions; ``mask`` is 1 on the tokens the policy generated. A
masked-out position inside a completion (a tool's answer in a multi-turn rollout) is skipped exactly as
verl skips observation tokens: the recursion carries the next generated token's value and advantage across
it, and it gets no TD error of its own.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from mmpo.core.aggregate import aggregate
from mmpo.core.kl import kl_penalty
from mmpo.core.masked import masked_mean, masked_whiten


def token_gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0,
              whiten: bool = True) -> tuple[Tensor, Tensor]:
    """GAE over the tokens of each completion (verl's ``compute_gae_advantage_return``).

    delta_t = r_t + gamma * V_{t'} - V_t with t' the next generated token (0 after the last);
    A_t = delta_t + gamma * lam * A_{t'}; returns R_t = A_t + V_t (before whitening).

    Args:
        token_rewards: ``(N, T)`` reward of each token (outcome on the last one, KL penalties).
        values: ``(N, T)`` V(s_t) of the old critic at each completion position.
        mask: ``(N, T)`` 1 on generated tokens.
        gamma, lam: discount and GAE lambda (verl's and TRL's PPO defaults: 1.0 and 0.95 / 1.0).
        whiten: normalise the advantages over the masked tokens of the batch (verl always does).

    Returns:
        ``(advantages, returns)``, both ``(N, T)``; advantages are 0 off the mask when whitened.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.ndim != 2:
        raise ValueError(f"token_gae expects equal (N, T) shapes, got rewards {tuple(token_rewards.shape)}, "
                         f"values {tuple(values.shape)}, mask {tuple(mask.shape)}")
    with torch.no_grad():
        mask = mask.to(values.dtype)
        token_rewards = token_rewards.to(values.dtype)
        next_values = torch.zeros_like(values[:, 0])
        running = torch.zeros_like(values[:, 0])
        reversed_advantages = []
        for t in reversed(range(values.shape[1])):
            delta = token_rewards[:, t] + gamma * next_values - values[:, t]
            candidate = delta + gamma * lam * running
            # off the mask (padding, a tool's answer) the next value and the running advantage pass through
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            running = candidate * mask[:, t] + (1 - mask[:, t]) * running
            reversed_advantages.append(running)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns


def clipped_value_loss(predicted: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       clip_range: float | None = 0.5,
                       agg: str | Callable[[Tensor, Tensor], Tensor] = "token-mean") -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss (verl's ``compute_value_loss``, TRL's PPO value loss).

    0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)) over the mask, and the fraction of tokens
    where the clipped term is the larger (``vf_clipfrac``). ``clip_range`` None: no clipping (plain MSE).
    ``agg``: an aggregation mode, or a callable ``(values, mask) -> 0-d`` (an ``Aggregation`` with the global
    token counts of a minibatch split into micro-batches).

    Returns:
        ``(loss, clipfrac)``: 0-d tensors; the loss carries the gradient of ``predicted``.
    """
    mask = mask.to(predicted.dtype)

    def reduce(values: Tensor) -> Tensor:
        return agg(values, mask) if callable(agg) else aggregate(values, mask, agg)

    unclipped = (predicted - returns) ** 2
    if clip_range is None:
        return 0.5 * reduce(unclipped), torch.zeros((), device=predicted.device)
    clipped_prediction = torch.clamp(predicted, old_values - clip_range, old_values + clip_range)
    clipped = (clipped_prediction - returns) ** 2
    loss = 0.5 * reduce(torch.max(unclipped, clipped))
    clipfrac = masked_mean(torch.gt(clipped, unclipped).to(predicted.dtype), mask)
    return loss, clipfrac.detach()


def rlhf_token_rewards(outcome: Tensor, mask: Tensor, *, log_probs: Tensor | None = None,
                       ref_log_probs: Tensor | None = None, kl_coef: float = 0.0,
                       kl_kind: str = "k1") -> Tensor:
    """``(N, T)`` token rewards of classic RLHF PPO: ``outcome`` (N,) on each completion's last generated
    token, minus ``kl_coef`` x KL(pi || pi_ref) estimated per token (``kl_kind``, verl's ``kl_penalty`` in
    reward: ``use_kl_in_reward``) on every generated token. A row without a generated token gets nothing."""
    mask_f = mask.to(outcome.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(dim=1)
    rewards = torch.zeros_like(mask_f)
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] = outcome[rows]
    if kl_coef:
        if log_probs is None or ref_log_probs is None:
            raise ValueError("a KL penalty in the reward (kl_coef > 0) needs log_probs and ref_log_probs")
        rewards = rewards - kl_coef * kl_penalty(log_probs.to(rewards.dtype), ref_log_probs.to(rewards.dtype),
                                                 kl_kind) * mask_f
    return rewards
