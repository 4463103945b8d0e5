"""BRPO: budget-relative advantages over truncated thinking budgets (AnytimeReasoner, arXiv 2505.13438).

Official code ``sail-sg/AnytimeReasoner`` (``verl/verl/trainer/ppo/brpo.py``); the formula and defaults
with their sources: ``docs/algorithm_sources.md`` section 12, BRPO.

A thinking trace is cut at S budgets b_1 < ... < b_S; at each cut, A summaries are sampled and scored.
r_{g,j} = the mean summary score of response g at budget j, and the objective is sum_j p_j r_{g,j}.
Thinking tokens of segment s (between b_{s-1} and b_s, 0-indexed) get
    A = R_{g,>=s} - (s V1 + (S - s) V2) / S,   R_{g,>=s} = sum_{j>=s} p_j r_{g,j},
    V2 = mean over the prompt's responses g' of R_{g',>=s},
    V1 = [sum_{j<s} 2^j r_{g,j} / sum_{j<s} 2^j] * sum_{j>=s} p_j   (own earlier budgets, recent ones weigh more);
summary tokens get score - mean of the A summaries of the same response and budget. No std anywhere.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, register_advantage_estimator
from mmpo.core.advantages_verl import _check_per_token
from mmpo.core.groups import GroupIndex

BUDGET_PRIORS = ("uniform", "linear", "base")


def budget_prior(prior: str | Sequence[float], num_budgets: int) -> Tensor:
    """``(S,)`` float64 prior p over the budgets b_j = (L / S) j: ``uniform`` 1/S, ``linear`` p_j ∝ b_j
    (= j / sum j), ``base`` all mass on the last budget; or explicit non-negative weights summing to 1."""
    if num_budgets < 1:
        raise ValueError(f"need at least one budget, got {num_budgets}")
    if isinstance(prior, str):
        if prior == "uniform":
            return torch.full((num_budgets,), 1.0 / num_budgets, dtype=torch.float64)
        if prior == "linear":
            j = torch.arange(1, num_budgets + 1, dtype=torch.float64)
            return j / j.sum()
        if prior == "base":
            p = torch.zeros(num_budgets, dtype=torch.float64)
            p[-1] = 1.0
            return p
        raise ValueError(f"unknown budget prior {prior!r}; valid: {list(BUDGET_PRIORS)} or a list of weights")
    p = torch.as_tensor(list(prior), dtype=torch.float64)
    if p.shape != (num_budgets,) or bool((p < 0).any()) or abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"budget prior must be {num_budgets} non-negative weights summing to 1, got {p.tolist()}")
    return p


def brpo_objective(budget_scores: Tensor, prior: str | Sequence[float] = "uniform") -> Tensor:
    """``(N,)`` the anytime objective sum_j p_j r_{g,j} of each response (its scalar reward)."""
    p = budget_prior(prior, budget_scores.shape[1]).to(budget_scores)
    return budget_scores @ p


def brpo_segment_advantages(
    budget_scores: Tensor, index: GroupIndex, prior: str | Sequence[float] = "uniform"
) -> Tensor:
    """``(N, S)`` advantage of each response's thinking segment s (the formula in the module docstring)."""
    n, num_budgets = budget_scores.shape
    p = budget_prior(prior, num_budgets).to(budget_scores)
    # R_{>=s}: reversed cumulative sum of p_j r_j
    weighted = budget_scores * p
    returns = weighted.flip(1).cumsum(1).flip(1)
    tail_mass = p.flip(0).cumsum(0).flip(0)  # sum_{j>=s} p_j
    advantages = torch.empty_like(budget_scores)
    for s in range(num_budgets):
        v2 = index.mean(returns[:, s])[index.inverse]
        if s == 0:
            baseline = v2
        else:
            w = 2.0 ** torch.arange(s, dtype=budget_scores.dtype, device=budget_scores.device)
            v1 = (budget_scores[:, :s] @ w) / w.sum() * tail_mass[s]
            baseline = (s * v1 + (num_budgets - s) * v2) / num_budgets
        advantages[:, s] = returns[:, s] - baseline
    return advantages


def brpo_summary_advantages(summary_scores: Tensor) -> Tensor:
    """``(N, S, A)`` summary advantages: each score minus the mean of the A summaries of the same
    response at the same budget."""
    if summary_scores.ndim != 3:
        raise ValueError(f"summary_scores must be (N, S, A), got shape {tuple(summary_scores.shape)}")
    return summary_scores - summary_scores.mean(-1, keepdim=True)


@register_advantage_estimator(AdvantageEstimator.BRPO)
def brpo_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    budget_scores: Tensor,
    segment_ids: Tensor,
    prior: str | Sequence[float] = "uniform",
) -> tuple[Tensor, Metrics]:
    """BRPO thinking-token advantages ``(N, T)``: token t of response g gets A_{g, segment_ids[g, t]}.

    Args:
        rewards: ``(N,)`` the objective sum_j p_j r_{g,j} (checked against ``budget_scores``).
        index: prompt groups (V2 averages over a prompt's responses).
        mask: ``(N, T)`` completion mask of the thinking traces.
        budget_scores: ``(N, S)`` mean summary score of each response at each budget.
        segment_ids: ``(N, T)`` budget segment (0 .. S-1) of each thinking token; -1 = no advantage.
        prior: ``uniform`` (default), ``linear``, ``base`` or S explicit weights.
    """
    mask = _check_per_token("mask", mask, rewards)
    if budget_scores.ndim != 2 or budget_scores.shape[0] != rewards.shape[0]:
        raise ValueError(f"budget_scores must be (N, S) with N = {rewards.shape[0]}, got {tuple(budget_scores.shape)}")
    budget_scores = budget_scores.to(rewards)
    objective = brpo_objective(budget_scores, prior)
    if not torch.allclose(objective, rewards, rtol=1e-5, atol=1e-6):
        raise ValueError("rewards must equal the prior-weighted budget scores sum_j p_j r_j (brpo_objective)")
    if segment_ids.shape != mask.shape:
        raise ValueError(f"segment_ids {tuple(segment_ids.shape)} and mask {tuple(mask.shape)} differ")
    num_budgets = budget_scores.shape[1]
    segment_ids = segment_ids.to(rewards.device).long()
    if bool(((segment_ids < -1) | (segment_ids >= num_budgets)).any()):
        raise ValueError(f"segment_ids must lie in -1 .. {num_budgets - 1}")
    per_segment = brpo_segment_advantages(budget_scores, index, prior)
    gathered = per_segment.gather(1, segment_ids.clamp_min(0))
    advantages = torch.where(segment_ids >= 0, gathered, torch.zeros_like(gathered)) * mask
    return advantages, {"advantages/brpo_objective_mean": float(objective.mean())}
