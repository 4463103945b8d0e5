"""PVPO's advantage: the on-policy reward minus a static, pre-estimated value (arXiv 2508.21104).

``A_i = r_i - V_hat(q_i)``: the dynamic Q (this rollout's reward) minus the static V, a Monte Carlo
mean of reference-policy rollout rewards for the prompt, estimated before training (and refreshed at
fixed intervals) rather than from the current group. The baseline table and its refresh live in
:mod:`mmpo.algos.pvpo`; this is the pure formula. No division by a std: the paper's equation and
secondary summaries show none; whether the authors' (unreleased) code divides is UNVERIFIED.
"""

from __future__ import annotations

from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, register_advantage_estimator
from mmpo.core.groups import GroupIndex


@register_advantage_estimator(AdvantageEstimator.PVPO)
def pvpo_advantages(rewards: Tensor, index: GroupIndex, *, static_values: Tensor) -> tuple[Tensor, Metrics]:
    """PVPO (arXiv 2508.21104): ``A_i = r_i - V_hat(q_i)``, independent of the current group.

    Args:
        rewards: ``(N,)``.
        index: group index of the N samples (the advantage does not use group statistics).
        static_values: ``(N,)`` the static value of each sample's prompt (the mean reward of the
            reference policy's rollouts of that prompt).
    """
    if static_values.shape != rewards.shape:
        raise ValueError(f"static_values must have the rewards' shape {tuple(rewards.shape)}, "
                         f"got {tuple(static_values.shape)}")
    values = static_values.to(rewards)
    return rewards - values, {"advantages/pvpo_static_value_mean": float(values.mean())}
