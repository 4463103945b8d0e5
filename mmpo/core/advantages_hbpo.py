"""HBPO's budget-aware reward and hierarchical advantage (Hierarchical Budget PO, arXiv 2507.15844).

Reference: the paper (Eq. 1-3 and Algorithm 1) and the official code, ZJU-REAL/HBPO at 5c8991d
(``rllm/rewards/math_reward.py``, ``verl/trainer/ppo/core_algos.py``), re-derived here:

- each rollout carries a token budget ``b`` (its subgroup); with ``f(x) = beta cos(pi x / (2 L_max))``,
  a correct response of ``n <= L_max`` tokens scores
  ``min(f(n) - alpha |n - b|, f(b))`` (``form="min"``, the official code) or the paper's piecewise
  ``f(b)`` if ``n <= b`` else ``f(n) - alpha |n - b|`` (``form="piecewise"``); anything else scores 0.
  Official: ``beta = 4``, ``L_max = 4096`` (the training context), ``alpha = 1 / L_max``;
- advantage ``A_ij = A_intra_i + A_inter_ij`` with ``A_intra_i = mean_{subgroup i}(R) - f(b_i)`` and
  ``A_inter_ij = (R_ij - mean_group(R)) / (std_group(R) + eps)`` over all rollouts of the query (unbiased
  std, eps 1e-6, as the code's GRPO part).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, register_advantage_estimator
from mmpo.core.groups import GroupIndex, build_group_index

BUDGET_REWARD_FORMS = ("min", "piecewise")


def cosine_budget_value(lengths: Tensor, *, max_length: int, beta: float = 4.0) -> Tensor:
    """``beta cos(pi x / (2 L_max))``: the cosine length reward at ``x`` tokens (HBPO's f_2 at ``x = b``)."""
    return beta * torch.cos(math.pi * lengths.double() / (2.0 * max_length))


def hbpo_rewards(
    correct: Tensor,
    lengths: Tensor,
    budgets: Tensor,
    *,
    max_length: int,
    beta: float = 4.0,
    alpha: float | None = None,
    form: str = "min",
) -> Tensor:
    """(N,) budget-aware reward of each response.

    Args:
        correct: ``(N,)`` bool, the answer is right.
        lengths: ``(N,)`` generated tokens ``n``.
        budgets: ``(N,)`` the response's subgroup budget ``b``.
        max_length: ``L_max`` (official 4096); longer responses score 0.
        beta: scale (official 4).
        alpha: deviation weight; None = ``1 / L_max`` (official).
        form: ``min`` (official code) or ``piecewise`` (paper Eq. 1).
    """
    if form not in BUDGET_REWARD_FORMS:
        raise ValueError(f"unknown HBPO reward form {form!r}; valid: {list(BUDGET_REWARD_FORMS)}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    alpha = 1.0 / max_length if alpha is None else alpha
    n, b = lengths.double(), budgets.double()
    explore = cosine_budget_value(n, max_length=max_length, beta=beta) - alpha * (n - b).abs()
    budget_value = cosine_budget_value(b, max_length=max_length, beta=beta)
    if form == "min":
        value = torch.minimum(explore, budget_value)
    else:
        value = torch.where(n <= b, budget_value, explore)
    ok = correct.bool() & (n <= max_length)
    return torch.where(ok, value, torch.zeros_like(value)).to(torch.float32)


@register_advantage_estimator(AdvantageEstimator.HBPO)
def hbpo_advantages(
    rewards: Tensor, index: GroupIndex, *, budgets: Tensor, max_length: int, beta: float = 4.0, eps: float = 1e-6
) -> tuple[Tensor, Metrics]:
    """HBPO (arXiv 2507.15844, Algorithm 1): ``(mean_subgroup R - f(b)) + (R - mean_group R) / (std_group R + eps)``.

    Args:
        rewards: ``(N,)`` budget-aware rewards (:func:`hbpo_rewards`).
        index: group index of the N samples (one group per query).
        budgets: ``(N,)`` each sample's budget; (query, budget) pairs form the subgroups.
        max_length: ``L_max`` of the budget baseline ``f(b)``.
        beta: scale of ``f``.
        eps: added to the group std.
    """
    if budgets.shape != rewards.shape:
        raise ValueError(f"budgets must have the rewards' shape {tuple(rewards.shape)}, got {tuple(budgets.shape)}")
    inter = (rewards - index.mean(rewards)[index.inverse]) / (index.std(rewards, unbiased=True)[index.inverse] + eps)
    # subgroups: one id per (query, budget) pair
    pairs = torch.stack([index.inverse.to(torch.long), budgets.to(torch.long)], -1)
    _, sub_ids = torch.unique(pairs, dim=0, return_inverse=True)
    sub = build_group_index(sub_ids, num_samples=rewards.numel(), min_size=1)
    baseline = cosine_budget_value(budgets, max_length=max_length, beta=beta).to(rewards.dtype)
    intra = sub.mean(rewards)[sub.inverse] - baseline
    return intra + inter, {"advantages/hbpo_intra_mean": float(intra.mean()),
                           "advantages/hbpo_inter_mean": float(inter.mean())}
