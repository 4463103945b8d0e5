"""LSPO: Length-aware dynamic Sampling Policy Optimization (arXiv 2510.01459).

A sampling filter on top of any GRPO-family loss (the paper pairs it with GRPO, DAPO and GSPO):

1. the zero-variance (accuracy) filter of DAPO drops groups whose rewards all agree;
2. of the remaining prompts, keep only those whose mean response length L(q) lies in the shortest
   band (L <= Q(low)) or the longest band (Q(high) <= L <= Q(max_quantile)), with Q the length
   quantiles of this batch's remaining prompts (``mmpo.core.lspo_filter``).

Dropped groups are masked out of the loss (the batch keeps its size, so DDP ranks stay in step).
The paper refills the batch like DAPO's dynamic sampling; here only the zero-variance refill
(``dynamic_sampling_retries``) exists, the length filter does not resample (docs/variants/lspo.md).
The band values are UNVERIFIED (docs/algorithm_sources.md section 9, LSPO): 0.3 / 0.65 / 0.95 are this
project's reading.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.training.variants import LengthBands
from mmpo.vlm.rollout import Rollout


class LSPOModule(GRPOModule):
    """GRPO with LSPO's length-band filter after the zero-variance filter.

    Args:
        model_path: saved HF model directory.
        lspo_low: quantile of the short band's upper edge (keep L(q) <= Q(lspo_low)).
        lspo_high: quantile of the long band's lower edge (keep Q(lspo_high) <= L(q) ...).
        lspo_max: ... <= Q(lspo_max), the long band's upper edge; 1.0 disables it.
        advantage: its ``dynamic_sampling`` is the zero-variance filter LSPO runs after (default on, as the paper).
        **kwargs: every :class:`GRPOModule` setting.

    Metrics: ``rewards/dropped_groups`` (zero-variance filter), ``lspo/dropped_groups`` (length
    filter), ``lspo/kept_frac`` (share of the batch's groups left in the loss).
    """

    def __init__(
        self,
        model_path: str,
        *,
        lspo_low: float = 0.3,
        lspo_high: float = 0.65,
        lspo_max: float = 0.95,
        advantage: AdvantageConfig = AdvantageConfig(dynamic_sampling=True),
        **kwargs: Any,
    ) -> None:
        bands = LengthBands(lspo_low, lspo_high, lspo_max)
        super().__init__(model_path, advantage=as_config(advantage, AdvantageConfig(dynamic_sampling=True)), **kwargs)
        self.length_bands = bands

    def filter_groups(self, rewards: Tensor, rollout: Rollout) -> tuple[Tensor | None, dict[str, float]]:
        candidates, metrics = super().filter_groups(rewards, rollout)
        lengths = rollout.completion_mask.sum(-1).to(rewards.device)
        keep, band_metrics = self.length_bands(lengths, rollout.group_ids.to(rewards.device), candidates)
        return keep, {**metrics, **band_metrics}
