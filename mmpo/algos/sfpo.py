"""SFPO: Slow-Fast Policy Optimization (arXiv 2510.04072; official code ``Urheen/SFPO``) for VLMs.

Wraps GRPOModule's whole update (any ``loss`` / ``advantage``) in ``mmpo.core.slow_fast``: per
rollout batch, K fast updates, a reposition theta_0 + alpha (theta_K - theta_0), one slow update;
old log-probs stay those of theta_0 throughout (they are computed even when the plain update
would be on-policy). An entropy z-score switch turns SFPO off for good (state saved in checkpoints).

Counting: every update pass makes its optimizer steps, so one SFPO batch makes (K + 1) x the plain
batch's optimizer steps; ``trainer.max_steps`` and the LR schedule count all of them (the official
code steps its scheduler once per batch; identical for the constant schedule it uses).
"""

from __future__ import annotations

from typing import Any

from mmpo.algos.grpo import GRPOModule
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.variants import SlowFastUpdate


class SFPOModule(CheckpointedState, GRPOModule):
    """GRPO whose update is SFPO's slow-fast update (:class:`~mmpo.training.variants.SlowFastUpdate`).

    Args:
        model_path: saved HF model directory.
        sfpo_inner_steps: K fast updates per batch (official 3).
        sfpo_alpha: reposition step size alpha in (0, 1] (official 0.8).
        sfpo_zscore_window: W entropies of the switch-off z-score (official 30).
        sfpo_zscore_threshold: switch SFPO off for good when z >= this (official 1.0).
        **kwargs: every :class:`GRPOModule` setting.
    """

    checkpointed_state = (("sfpo_switch", "update_wrapper"),)

    def __init__(
        self,
        model_path: str,
        *,
        sfpo_inner_steps: int = 3,
        sfpo_alpha: float = 0.8,
        sfpo_zscore_window: int = 30,
        sfpo_zscore_threshold: float = 1.0,
        **kwargs: Any,
    ) -> None:
        wrapper = SlowFastUpdate(sfpo_inner_steps, sfpo_alpha, sfpo_zscore_window, sfpo_zscore_threshold)
        super().__init__(model_path, **kwargs)
        self.update_wrapper = wrapper
