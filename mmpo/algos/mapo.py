"""MAPO: Mixed Advantage Policy Optimization (arXiv 2509.18849).

GRPO with the MAPO advantage estimator from ``mmpo.core`` (name ``mapo``):

1. p = (rollouts with reward exactly 1.0) / G per prompt (trajectory certainty).
2. lambda(p) = 1 - 4 p (1 - p) (0 at p = 1/2, 1 at p in {0, 1}).
3. A_i = (1 - lambda) (r_i - mu) / (sigma + eps) + lambda (r_i - mu) / (mu + eps), eps 1e-6;
   groups with mu <= 0 fall back to the std form and are counted.

Everything else is the GRPO step. Statistics are keyed by prompt id (the official code keys
them by batch position, which breaks when the batch is reordered; docs/algorithm_sources.md section 3).
The ablations ``mapo_apd`` (APD only) and ``mapo_random_lambda`` are the same module with
another ``advantage``. This module only adds the lambda / success-rate metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.core.groups import build_group_index
from mmpo.vlm.rollout import Rollout

MAPO_ESTIMATORS = ("mapo", "mapo_apd", "mapo_random_lambda")


def certainty_lambda(rewards: Tensor, group_ids: Tensor, *, success_value: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-prompt success fraction p and lambda(p) = 1 - 4p(1-p) (arXiv 2509.18849, Eq. 7).

    Args:
        rewards: ``(N,)`` rewards.
        group_ids: ``(N,)`` prompt ids, any order.
        success_value: the reward of a fully correct rollout (exact equality).

    Returns:
        ``(p, lambda)``, each ``(num_groups,)`` in ascending group-id order.
    """
    index = build_group_index(group_ids, num_samples=rewards.numel())
    p = index.sum((rewards == success_value).to(torch.float32)) / index.counts.to(torch.float32)
    return p, 1.0 - 4.0 * p * (1.0 - p)


class MAPOModule(GRPOModule):
    """GRPO with MAPO's mixed advantage (arXiv 2509.18849) and its diagnostics.

    Args:
        model_path: saved HF model directory.
        advantage: its ``name`` is ``mapo`` (paper), or the ablations ``mapo_apd`` / ``mapo_random_lambda``.
        **kwargs: every :class:`GRPOModule` setting (paper: beta 0.01 k3, clip 0.2/0.3, G 12 or 8).
    """

    def __init__(self, model_path: str, *, advantage: AdvantageConfig = AdvantageConfig(name="mapo"),
                 **kwargs: Any) -> None:
        advantage = as_config(advantage, AdvantageConfig(name="mapo"))
        require(advantage.name in MAPO_ESTIMATORS,
                f"MAPOModule advantage must be one of {MAPO_ESTIMATORS}, got {advantage.name!r}")
        super().__init__(model_path, advantage=advantage, **kwargs)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
        p, lam = certainty_lambda(rewards, group_ids)
        metrics["mapo/success_frac"] = float(p.mean())
        metrics["mapo/fallback_groups"] = metrics.get("advantages/mapo_fallback_groups", 0.0)
        if self.advantage.name == "mapo":
            metrics["mapo/lambda_mean"] = float(lam.mean())
            metrics["mapo/lambda_min"] = float(lam.min())
            metrics["mapo/lambda_max"] = float(lam.max())
        return advantages, metrics
