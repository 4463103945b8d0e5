"""Advantage estimators of verl's ``core_algos.py`` (commit b178a3cd), behind mmpo's registry.

Same shared signature as :mod:`mmpo.core.advantages` (``fn(rewards, index, *, <settings>)``);
estimators that need per-token inputs take them as keyword settings:

- ``mask`` ``(N, T)``: the response mask (1 on completion tokens). Estimators taking it may
  return ``(N, T)`` per-token advantages (zero off the mask); the policy loss accepts both.
- ``token_rewards`` ``(N, T)`` (REINFORCE++, optimal token baseline): per-token rewards; without it the sequence
  reward sits on the last masked-in token, as verl places an outcome score.
- ``reward_baselines`` ``(N,)`` (ReMax): the reward of the greedy rollout of each sample's prompt.
- ``old_log_probs``, ``sum_pi_squared`` ``(N, T)`` (optimal token baseline): log pi of the sampled
  tokens and sum_v pi_v^2 at each position, under the rollout policy.

REINFORCE++, REINFORCE++-baseline and ReMax accept a group of one sample (verl and OpenRLHF run
them at n = 1; the baseline variant's singleton group has mean 0, as verl's). Differences from verl
(all in docs/core.md, "verl's estimators"): for the group-relative estimators a group of one sample
is an error here (verl silently uses a baseline of 0), and OPO's length-weighted baseline of a group
whose completions are all empty is 0 (verl divides 0 by 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, register_advantage_estimator
from mmpo.core.groups import GroupIndex
from mmpo.core.masked import masked_whiten


#: the names this module registers (members of :class:`~mmpo.core.advantages.AdvantageEstimator`)
VERL_ADVANTAGE_ESTIMATORS = (
    AdvantageEstimator.REINFORCE_PLUS_PLUS,
    AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE,
    AdvantageEstimator.OPO,
    AdvantageEstimator.GRPO_PASSK,
    AdvantageEstimator.GPG,
    AdvantageEstimator.REMAX,
    AdvantageEstimator.OPTIMAL_TOKEN_BASELINE,
    AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE,
)


def _check_per_token(name: str, value: Tensor, rewards: Tensor) -> Tensor:
    if value.ndim != 2 or value.shape[0] != rewards.shape[0]:
        raise ValueError(f"{name} must be (N, T) with N = {rewards.shape[0]}, got shape {tuple(value.shape)}")
    return value.to(device=rewards.device, dtype=rewards.dtype)


def _check_per_sample(name: str, value: Tensor, rewards: Tensor) -> Tensor:
    if value.shape != rewards.shape:
        raise ValueError(f"{name} must be (N,) = {tuple(rewards.shape)}, got shape {tuple(value.shape)}")
    value = value.to(device=rewards.device, dtype=rewards.dtype)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite")
    return value


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``(N, T)`` zeros with each sequence reward on its last masked-in token (verl's outcome placement).

    A row with an empty mask carries no reward (it has no token to put it on).
    """
    mask = mask.to(rewards.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(dim=1)
    out = torch.zeros_like(mask)
    has_token = last >= 0
    rows = torch.nonzero(has_token).flatten()
    out[rows, last[has_token]] = rewards[has_token]
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1}, with the running return reset at every masked-out position.

    The reset (verl's "reset after EOS") keeps padding rewards and later turns out of earlier
    returns. Masked-out positions hold their own reward plus nothing from later positions.
    """
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@register_advantage_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS, min_group_size=1)
def reinforce_plus_plus_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    gamma: float = 1.0,
    token_rewards: Tensor | None = None,
    whiten_eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """REINFORCE++ (arXiv 2501.03262; verl ``compute_reinforce_plus_plus_outcome_advantage``).

    Token returns G_t = sum_{k>=t} gamma^(k-t) r_k (reset at masked-out positions), then
    whitened over every masked-in token of the batch: A = (G - mean) / sqrt(var + eps) (Bessel
    var), 0 off the mask. Groups play no part (no baseline but the batch mean).

    Args:
        rewards: ``(N,)`` sequence rewards (placed on the last masked-in token unless
            ``token_rewards`` is given).
        index: group index of the N samples (unused by the math).
        mask: ``(N, T)`` response mask.
        gamma: discount (verl's ``algorithm.gamma``, default 1.0).
        token_rewards: ``(N, T)`` per-token rewards; their masked sum per row must equal ``rewards``.
        whiten_eps: eps of the whitening (verl's ``masked_whiten``: 1e-8).

    Returns:
        ``(N, T)`` advantages.
    """
    mask = _check_per_token("mask", mask, rewards)
    if token_rewards is None:
        token_rewards = outcome_token_rewards(rewards, mask)
    else:
        token_rewards = _check_per_token("token_rewards", token_rewards, rewards)
        if token_rewards.shape != mask.shape:
            raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and mask {tuple(mask.shape)} differ")
        if not torch.allclose((token_rewards * mask).sum(-1), rewards, rtol=1e-5, atol=1e-6):
            raise ValueError("rewards must equal the masked per-row sum of token_rewards")
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=whiten_eps), {}


@register_advantage_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, min_group_size=1)
def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, index: GroupIndex, *, mask: Tensor, whiten_eps: float = 1e-8
) -> tuple[Tensor, Metrics]:
    """REINFORCE++-baseline (arXiv 2501.03262; verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``).

    r_i - mean of the group, broadcast to the sample's masked-in tokens, then whitened over
    every masked-in token of the batch (so longer completions weigh more in the statistics).
    A group of one sample has mean 0 (verl's ``id2mean = 0`` for a singleton; OpenRLHF at n = 1), so
    its r_i enters the whitening unchanged; groups may differ in size.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        mask: ``(N, T)`` response mask.
        whiten_eps: eps of the whitening (verl: 1e-8).

    Returns:
        ``(N, T)`` advantages.
    """
    mask = _check_per_token("mask", mask, rewards)
    group_mean = torch.where(index.counts > 1, index.mean(rewards), torch.zeros_like(index.mean(rewards)))
    centred = rewards - group_mean[index.inverse]
    return masked_whiten(centred.unsqueeze(-1) * mask, mask, eps=whiten_eps), {}


@register_advantage_estimator(AdvantageEstimator.OPO)
def opo_advantages(rewards: Tensor, index: GroupIndex, *, mask: Tensor) -> tuple[Tensor, Metrics]:
    """OPO (arXiv 2505.23585; verl ``compute_opo_outcome_advantage``): length-weighted group baseline.

    b_g = sum_i L_i r_i / sum_i L_i over the group (L_i = completion length from ``mask``);
    A_i = r_i - b_g. A group whose completions are all empty gets b = 0.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        mask: ``(N, T)`` response mask (only its row sums are used).
    """
    lengths = _check_per_token("mask", mask, rewards).sum(-1)
    baseline = index.sum(lengths * rewards) / index.sum(lengths).clamp(min=1.0)
    return rewards - baseline[index.inverse], {}


@register_advantage_estimator(AdvantageEstimator.GRPO_PASSK)
def grpo_passk_advantages(
    rewards: Tensor, index: GroupIndex, *, eps: float = 1e-6, norm_adv_by_std: bool = True
) -> tuple[Tensor, Metrics]:
    """Pass@k GRPO (arXiv 2503.19595; verl ``compute_grpo_passk_outcome_advantage``).

    Only the best sample of each group gets a non-zero advantage, r_max - r_second_max
    (divided by the group's Bessel std + eps with ``norm_adv_by_std``); every other sample gets 0.
    A tie at the top gives the whole group 0 (r_max = r_second_max).

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        eps: added to the group std.
        norm_adv_by_std: verl's ``norm_adv_by_std_in_grpo``.
    """
    best = index.amax(rewards)
    is_best = rewards == best[index.inverse]
    num_best = index.sum(is_best.to(rewards.dtype))
    runner_up = index.amax(torch.where(is_best, torch.full_like(rewards, -torch.inf), rewards))
    second = torch.where(num_best > 1, best, runner_up)
    gap = best - second
    if norm_adv_by_std:
        gap = gap / (index.std(rewards, unbiased=True) + eps)
    advantages = torch.where(is_best, gap[index.inverse], torch.zeros_like(rewards))
    return advantages, {}


@register_advantage_estimator(AdvantageEstimator.GPG)
def gpg_advantages(rewards: Tensor, index: GroupIndex, *, f_norm: float = 1.0) -> tuple[Tensor, Metrics]:
    """GPG advantage (arXiv 2504.02546; verl ``compute_gpg_outcome_advantage``).

    A_i = alpha (r_i - mean_g) / f_norm with the batch correction alpha = N / max(1, #{i: r_i != 0})
    (the samples with a non-zero reward in this call's batch; under DDP, in this rank's batch).
    Logged as ``advantages/gpg_alpha``.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        f_norm: divisor (verl's default 1.0).
    """
    if f_norm == 0:
        raise ValueError("f_norm must be non-zero")
    nonzero = int(torch.count_nonzero(rewards))
    alpha = rewards.numel() / max(nonzero, 1)
    advantages = alpha * (rewards - index.mean(rewards)[index.inverse]) / f_norm
    return advantages, {"advantages/gpg_alpha": float(alpha)}


@register_advantage_estimator(AdvantageEstimator.REMAX, min_group_size=1)
def remax_advantages(rewards: Tensor, index: GroupIndex, *, reward_baselines: Tensor) -> tuple[Tensor, Metrics]:
    """ReMax (arXiv 2310.10505; verl ``compute_remax_outcome_advantage``): A_i = r_i - b_i.

    b_i is the reward of the greedy completion of sample i's prompt (GRPOModule samples it
    when ``advantage: remax``). With an outcome reward verl's per-token return is r_i on every
    completion token, so the advantage is the same on every token.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples (unused by the math).
        reward_baselines: ``(N,)`` greedy-rollout reward of each sample's prompt.
    """
    baselines = _check_per_sample("reward_baselines", reward_baselines, rewards)
    return rewards - baselines, {"advantages/remax_baseline_mean": float(baselines.mean())}


def reward_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """G_t = sum_{k>=t} r_k m_k (undiscounted, masked rewards; verl's OTB / ReMax returns)."""
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _per_group_token_sum(index: GroupIndex, values: Tensor) -> Tensor:
    """``(N, T)`` -> ``(num_groups, T)`` per-group sums at each token position."""
    out = torch.zeros(index.num_groups, values.shape[1], dtype=values.dtype, device=values.device)
    return out.index_add(0, index.inverse, values)


def _token_baseline(
    index: GroupIndex, returns: Tensor, weights: Tensor, valid: Tensor, member: Tensor,
    *, handle_zero_tail: bool, eps: float,
) -> Tensor:
    """B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps) over the group's members at position t.

    ``member`` marks the samples that count (all, or the non-empty ones); a group with fewer
    than two members gets baseline 0. With ``handle_zero_tail`` the baseline of a group's unique
    longest member is 0 from the second-longest member's length on (no one else covers it).
    """
    weights = weights * valid * member.unsqueeze(-1)
    baseline_g = _per_group_token_sum(index, returns * weights) / (_per_group_token_sum(index, weights) + eps)
    members_g = index.sum(member.to(returns.dtype))
    baseline = torch.where((members_g >= 2)[index.inverse].unsqueeze(-1), baseline_g[index.inverse],
                           torch.zeros_like(returns))
    if handle_zero_tail:
        lengths = torch.where(member, valid.sum(-1), torch.full_like(valid[:, 0], -1.0))
        longest = index.amax(lengths)
        is_longest = lengths == longest[index.inverse]
        unique = index.sum(is_longest.to(lengths.dtype)) == 1
        second = index.amax(torch.where(is_longest, torch.full_like(lengths, -torch.inf), lengths))
        cut = is_longest & unique[index.inverse] & (longest > second)[index.inverse] & member
        positions = torch.arange(returns.shape[1], device=returns.device).to(returns.dtype)
        tail = cut.unsqueeze(-1) & (positions.unsqueeze(0) >= second[index.inverse].unsqueeze(-1))
        baseline = baseline.masked_fill(tail, 0.0)
    return baseline


def _otb_inputs(
    rewards: Tensor, mask: Tensor, old_log_probs: Tensor, sum_pi_squared: Tensor,
    token_rewards: Tensor | None, rollout_is_weights: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(mask, reward-to-go G, cumulative path-variance proxy W) of the OTB estimators."""
    mask = _check_per_token("mask", mask, rewards)
    old_log_probs = _check_per_token("old_log_probs", old_log_probs, rewards)
    sum_pi_squared = _check_per_token("sum_pi_squared", sum_pi_squared, rewards)
    if token_rewards is None:
        token_rewards = outcome_token_rewards(rewards, mask)
    else:
        token_rewards = _check_per_token("token_rewards", token_rewards, rewards)
    # ||s_t||^2 = 1 - 2 pi_t + sum_v pi_v^2: the squared norm of the score of the softmax logits
    per_token = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * _check_per_token("rollout_is_weights", rollout_is_weights, rewards) ** 2
    return mask, reward_to_go(token_rewards, mask), (per_token * mask).cumsum(-1)


@register_advantage_estimator(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE)
def optimal_token_baseline_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    token_rewards: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = False,
    baseline_eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """Optimal token baseline (verl ``compute_optimal_token_baseline_advantage``).

    G_t = reward-to-go; w_t = 1 - 2 pi_t + sum_v pi_v^2 (times rho_t^2 with rollout IS
    weights); W_t = sum_{j<=t} w_j; per group and token position t,
    B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps); A_t = (G_t - B_t) on the mask.

    Args:
        rewards: ``(N,)`` (on the last masked-in token unless ``token_rewards`` is given).
        index: group index of the N samples.
        mask: ``(N, T)`` response mask.
        old_log_probs: ``(N, T)`` log pi of the sampled tokens under the rollout policy.
        sum_pi_squared: ``(N, T)`` sum over the vocabulary of pi^2 at each position.
        token_rewards: ``(N, T)`` per-token rewards.
        rollout_is_weights: ``(N, T)`` truncated IS weights (rollout engine vs trainer), or None.
        handle_zero_tail: zero the baseline of a group's unique longest completion beyond the
            second-longest one.
        baseline_eps: eps of the baseline's denominator (verl: 1e-8).

    Returns:
        ``(N, T)`` advantages.
    """
    mask, returns, weights = _otb_inputs(rewards, mask, old_log_probs, sum_pi_squared, token_rewards,
                                         rollout_is_weights)
    member = torch.ones_like(rewards, dtype=torch.bool)
    baseline = _token_baseline(index, returns, weights, mask, member, handle_zero_tail=handle_zero_tail,
                               eps=baseline_eps)
    return (returns - baseline) * mask, {}


@register_advantage_estimator(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE)
def tir_optimal_token_baseline_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    token_rewards: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    baseline_eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """Multi-turn (tool-integrated) optimal token baseline (verl
    ``compute_multi_turn_optimal_token_baseline_advantage``).

    As :func:`optimal_token_baseline_advantages`, but the baseline is aligned by the k-th
    masked-in token of each completion (not by position), so masks with holes (tool outputs
    between turns) line up; empty completions leave their group, and a group with fewer than
    two non-empty completions gets baseline 0. ``handle_zero_tail`` defaults to True (verl).
    """
    mask, returns, weights = _otb_inputs(rewards, mask, old_log_probs, sum_pi_squared, token_rewards,
                                         rollout_is_weights)
    # compact each row's masked-in tokens to the front: slot k holds the row's k-th valid token
    lengths = mask.sum(-1).long()
    width = max(int(lengths.max()), 1)
    rows, cols = torch.nonzero(mask > 0, as_tuple=True)
    slots = (mask.cumsum(-1) - 1).long()[rows, cols]
    compact_returns = torch.zeros(mask.shape[0], width, dtype=returns.dtype, device=returns.device)
    compact_weights = torch.zeros_like(compact_returns)
    compact_returns[rows, slots] = returns[rows, cols]
    compact_weights[rows, slots] = weights[rows, cols]
    valid = (torch.arange(width, device=mask.device).unsqueeze(0) < lengths.unsqueeze(-1)).to(returns.dtype)
    baseline = _token_baseline(index, compact_returns, compact_weights, valid, lengths > 0,
                               handle_zero_tail=handle_zero_tail, eps=baseline_eps)
    advantages = torch.zeros_like(returns)
    advantages[rows, cols] = (compact_returns - baseline)[rows, slots]
    return advantages, {}
