"""Group-relative advantage estimators (one scalar per sample) and GAE.

Every estimator has the shared signature
``fn(rewards: (N,), index: GroupIndex, *, <settings>) -> (advantages (N,), metrics)``
and is registered by name; call them through :func:`compute_advantages`. Statistics are
keyed by group id (see :mod:`mmpo.core.groups`), so shuffling the batch permutes the output
identically and groups may differ in size. Each estimator declares the smallest group it accepts
(:func:`min_group_size`: 2 for the group-relative ones, 1 for REINFORCE++ and ReMax, which run at
one sample per prompt as in verl and OpenRLHF); a smaller group is a one-line error naming both.
"""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Callable

import torch
from torch import Tensor

from mmpo.core._settings import check_settings
from mmpo.core.groups import GroupIndex, build_group_index
from mmpo.core.registry import Registry

Metrics = dict[str, float]
AdvantageFn = Callable[..., tuple[Tensor, Metrics]]


class AdvantageEstimator(str, Enum):
    """Built-in advantage estimator names."""

    GRPO = "grpo"
    DRGRPO = "drgrpo"
    RLOO = "rloo"
    MAPO = "mapo"
    MAPO_APD = "mapo_apd"
    MAPO_RANDOM_LAMBDA = "mapo_random_lambda"
    # verl's estimators, registered in mmpo.core.advantages_verl
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    REMAX = "remax"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    # HAPO's token-level estimator, registered in mmpo.core.hapo
    HAPO = "hapo"
    # issue-16 variants, registered in their own modules
    PVPO = "pvpo"  # mmpo.core.advantages_pvpo
    HBPO = "hbpo"  # mmpo.core.advantages_hbpo
    # structured-rollout estimators (issue 16): advantages_budget, advantages_tree, advantages_truncated
    BRPO = "brpo"
    TREEPO = "treepo"
    SEGMENT = "segment"
    TPPO = "tppo"


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
#: estimator name -> smallest group (samples per prompt) it accepts; see :func:`min_group_size`
_MIN_GROUP_SIZES: dict[str, int] = {}


def _estimator_key(name: str | AdvantageEstimator) -> str:
    return str(name.value) if isinstance(name, Enum) else name


def register_advantage_estimator(
    name: str | AdvantageEstimator, *, min_group_size: int = 2
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(rewards, index, *, **settings) -> (advantages, metrics)`` under ``name``.

    Args:
        name: the registry name.
        min_group_size: smallest group the estimator accepts (2 for group-relative statistics; 1 for
            estimators that need no group, such as REINFORCE++).
    """
    if min_group_size < 1:
        raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")
    register = ADVANTAGE_ESTIMATORS.register(name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        register(fn)
        _MIN_GROUP_SIZES[_estimator_key(name)] = min_group_size
        return fn

    return decorator


def min_group_size(name: str | AdvantageEstimator) -> int:
    """The smallest group (samples per prompt) the registered estimator ``name`` accepts."""
    ADVANTAGE_ESTIMATORS.get(name)  # an unknown name fails listing the valid ones
    return _MIN_GROUP_SIZES.get(_estimator_key(name), 2)


def _float_rewards(rewards: Tensor) -> Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if not rewards.dtype.is_floating_point:
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:10]
        raise ValueError(f"rewards must be finite; non-finite at positions {bad}")
    return rewards


def compute_advantages_with_metrics(
    name: str | AdvantageEstimator, rewards: Tensor, group_ids: Tensor, **settings
) -> tuple[Tensor, Metrics]:
    """Compute per-sample advantages and the estimator's metrics.

    Args:
        name: a registered estimator (see :class:`AdvantageEstimator`).
        rewards: ``(N,)`` scalar reward per sample.
        group_ids: ``(N,)`` integer prompt id per sample, in any order.
        **settings: the estimator's keyword settings (unknown ones raise ValueError).

    Returns:
        advantages ``(N,)`` (rewards' float dtype) and a metrics dict of floats, always with
        ``rewards/frac_zero_std`` (fraction of groups whose rewards all agree) and
        ``advantages/num_groups``.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    key = _estimator_key(name)
    check_settings(fn, settings, family="advantage estimator", name=key, num_tensor_args=2)
    # per-token inputs (``mask``, ``reward_baselines``) are required settings of some estimators
    missing = [p.name for p in inspect.signature(fn).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
               and p.name not in settings]
    if missing:
        raise ValueError(f"advantage estimator {key!r} needs the input(s) {missing}")
    rewards = _float_rewards(rewards)
    index = build_group_index(group_ids.to(rewards.device), num_samples=rewards.numel(), min_size=1)
    smallest = min_group_size(key)
    too_small = index.counts < smallest
    if bool(too_small.any()):
        raise ValueError(
            f"advantage estimator {key!r} needs at least {smallest} samples per group; group(s) "
            f"{index.ids[too_small].tolist()[:10]} have {index.counts[too_small].tolist()[:10]} "
            f"(set sampling.num_generations >= {smallest}, or use reinforce_plus_plus / remax at one sample)")
    if not bool(torch.isfinite(index.sum(rewards.square())).all()):
        raise ValueError(
            f"advantage estimator {key!r}: rewards up to |r| = {float(rewards.abs().max()):.3g} overflow the group "
            f"statistics in {rewards.dtype} (a sum of squares is inf); bound them (mmpo.rewards clamps |r| <= 1e6) "
            "or pass float64")
    advantages, metrics = fn(rewards, index, **settings)
    zero_std = index.is_constant(rewards)
    out: Metrics = {
        "rewards/frac_zero_std": float(zero_std.to(rewards.dtype).mean()),
        "advantages/num_groups": float(index.num_groups),
    }
    out.update(metrics)
    return advantages, out


def compute_advantages(name: str | AdvantageEstimator, rewards: Tensor, group_ids: Tensor, **settings) -> Tensor:
    """Per-sample advantages ``(N,)``; see :func:`compute_advantages_with_metrics` for arguments."""
    return compute_advantages_with_metrics(name, rewards, group_ids, **settings)[0]


@register_advantage_estimator(AdvantageEstimator.GRPO)
def grpo_advantages(
    rewards: Tensor, index: GroupIndex, *, eps: float = 1e-6, unbiased_std: bool = True
) -> tuple[Tensor, Metrics]:
    """GRPO (arXiv 2402.03300): A_i = (r_i - mean_g) / (std_g + eps).

    Defaults follow verl / EasyR1: Bessel-corrected std and eps = 1e-6 (TRL uses 1e-4).
    A group whose rewards all agree gets A = 0.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        eps: added to the group std.
        unbiased_std: Bessel correction (divide by G - 1).
    """
    mean = index.mean(rewards)[index.inverse]
    std = index.std(rewards, unbiased=unbiased_std)[index.inverse]
    return (rewards - mean) / (std + eps), {}


@register_advantage_estimator(AdvantageEstimator.DRGRPO)
def drgrpo_advantages(rewards: Tensor, index: GroupIndex) -> tuple[Tensor, Metrics]:
    """Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g, no std division (removes difficulty bias).

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
    """
    return rewards - index.mean(rewards)[index.inverse], {}


@register_advantage_estimator(AdvantageEstimator.RLOO)
def rloo_advantages(rewards: Tensor, index: GroupIndex) -> tuple[Tensor, Metrics]:
    """RLOO (arXiv 2402.14740): A_i = r_i - mean of the other G-1 rewards of the group.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
    """
    total = index.sum(rewards)[index.inverse]
    n = index.counts.to(rewards.dtype)[index.inverse]
    return rewards - (total - rewards) / (n - 1.0), {}


def _mapo_mix(
    rewards: Tensor, index: GroupIndex, lam_per_group: Tensor, *, eps: float, unbiased_std: bool
) -> tuple[Tensor, Metrics]:
    """A = (1 - lambda) A_std + lambda A_apd, with the std form where mean <= 0 (APD undefined)."""
    mean_g = index.mean(rewards)
    std_g = index.std(rewards, unbiased=unbiased_std)
    mean, std = mean_g[index.inverse], std_g[index.inverse]
    centred = rewards - mean
    adv_std = centred / (std + eps)
    # APD divides by the group mean; for mean <= 0 it is undefined (or sign-flipped), so those
    # groups fall back to the std form. Groups whose rewards all agree give 0 either way, so
    # only non-constant groups count as fallbacks.
    apd_undefined_g = mean_g <= 0
    fallback_g = apd_undefined_g & ~index.is_constant(rewards)
    apd_undefined = apd_undefined_g[index.inverse]
    safe_mean = torch.where(apd_undefined, torch.ones_like(mean), mean)
    adv_apd = centred / (safe_mean + eps)
    lam = lam_per_group[index.inverse]
    mixed = (1.0 - lam) * adv_std + lam * adv_apd
    advantages = torch.where(apd_undefined, adv_std, mixed)
    metrics = {
        "advantages/mapo_fallback_groups": float(fallback_g.sum()),
        "advantages/mapo_lambda_mean": float(lam_per_group.mean()),
    }
    return advantages, metrics


def _success_fraction(rewards: Tensor, index: GroupIndex) -> Tensor:
    # Success means the reward is exactly 1.0 (all components correct), as the MAPO code does.
    return index.sum((rewards == 1.0).to(rewards.dtype)) / index.counts.to(rewards.dtype)


@register_advantage_estimator(AdvantageEstimator.MAPO)
def mapo_advantages(
    rewards: Tensor, index: GroupIndex, *, eps: float = 1e-6, unbiased_std: bool = True
) -> tuple[Tensor, Metrics]:
    """MAPO mixed advantage (arXiv 2509.18849, code ``grpomixpro``).

    p = fraction of the group with reward exactly 1.0; lambda(p) = 1 - 4 p (1 - p);
    A_i = (1 - lambda) (r_i - mu) / (sigma + eps) + lambda (r_i - mu) / (mu + eps).
    All-correct and all-zero groups give 0. A non-constant group with mu <= 0 (APD undefined)
    falls back to the std form and is counted in ``advantages/mapo_fallback_groups``.
    Rewards should be non-negative with 1.0 meaning fully correct.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        eps: 1e-6 in both denominators (paper).
        unbiased_std: Bessel-corrected sigma (the code's ``torch.std``).
    """
    p = _success_fraction(rewards, index)
    lam = 1.0 - 4.0 * p * (1.0 - p)
    return _mapo_mix(rewards, index, lam, eps=eps, unbiased_std=unbiased_std)


@register_advantage_estimator(AdvantageEstimator.MAPO_APD)
def mapo_apd_advantages(
    rewards: Tensor, index: GroupIndex, *, eps: float = 1e-6, unbiased_std: bool = True
) -> tuple[Tensor, Metrics]:
    """MAPO ablation "APD only" (arXiv 2509.18849, code ``grpomean``): A_i = (r_i - mu) / (mu + eps).

    Groups with mu <= 0 fall back to (r_i - mu) / (sigma + eps) and are counted.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        eps: 1e-6.
        unbiased_std: Bessel-corrected sigma for the fallback.
    """
    lam = torch.ones(index.num_groups, dtype=rewards.dtype, device=rewards.device)
    return _mapo_mix(rewards, index, lam, eps=eps, unbiased_std=unbiased_std)


@register_advantage_estimator(AdvantageEstimator.MAPO_RANDOM_LAMBDA)
def mapo_random_lambda_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    generator: torch.Generator | None = None,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> tuple[Tensor, Metrics]:
    """MAPO ablation "random lambda" (arXiv 2509.18849, code ``grporandpro``): lambda ~ U[0, 1] per group.

    One draw per distinct group id, in ascending id order, so the result is reproducible with
    a seeded ``generator`` and independent of batch order.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples.
        generator: seeded ``torch.Generator`` on the rewards' device (None: global RNG).
        eps: 1e-6.
        unbiased_std: Bessel-corrected sigma.
    """
    lam = torch.rand(index.num_groups, generator=generator, dtype=rewards.dtype, device=rewards.device)
    return _mapo_mix(rewards, index, lam, eps=eps, unbiased_std=unbiased_std)


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (arXiv 1506.02438) over time-major rollouts.

    delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t
    A_t = delta_t + gamma * lam * (1 - (terminated_t or truncated_t)) * A_{t+1}

    ``next_values[t]`` is V(s_{t+1}) of the observation reached by step t (for a truncated step,
    the value of the final observation before the reset). A termination does not bootstrap; a
    truncation does. The recursion is cut at both kinds of episode end, so nothing leaks
    across episodes; the last step is treated as cut.

    Args:
        rewards: ``(T, N)`` reward of each step.
        values: ``(T, N)`` V(s_t).
        next_values: ``(T, N)`` V(s_{t+1}).
        terminated: ``(T, N)`` bool/0-1: the episode ended in a terminal state at step t.
        truncated: ``(T, N)`` bool/0-1: the episode was cut (time limit) at step t.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        advantages ``(T, N)`` and returns ``(T, N)`` (= advantages + values).
    """
    shapes = {n: tuple(t.shape) for n, t in
              dict(rewards=rewards, values=values, next_values=next_values,
                   terminated=terminated, truncated=truncated).items()}
    if len(set(shapes.values())) != 1 or rewards.ndim != 2:
        raise ValueError(f"gae expects equal (T, N) shapes, got {shapes}")
    dtype = values.dtype if values.dtype.is_floating_point else torch.get_default_dtype()
    rewards = rewards.to(dtype)
    values = values.to(dtype)
    next_values = next_values.to(dtype)
    not_terminal = 1.0 - terminated.to(dtype)
    not_done = 1.0 - (terminated.bool() | truncated.bool()).to(dtype)
    deltas = rewards + gamma * not_terminal * next_values - values
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = deltas[t] + gamma * lam * not_done[t] * running
        advantages[t] = running
    return advantages, advantages + values
