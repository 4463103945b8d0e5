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

import math
from typing import Any

from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.core.slow_fast import EntropyZScoreSwitch, slow_fast_update
from mmpo.vlm.rollout import Rollout
from mmpo.training.state_hooks import CheckpointedState


def sfpo_metrics(active: bool, switch: EntropyZScoreSwitch) -> dict[str, float]:
    """``sfpo/active`` (1 while SFPO runs) and, once W entropies are recorded, ``sfpo/entropy_zscore``."""
    metrics = {"sfpo/active": float(active)}
    if not math.isnan(switch.last_z):
        metrics["sfpo/entropy_zscore"] = switch.last_z
    return metrics


class SFPOModule(CheckpointedState, GRPOModule):
    """GRPO whose update is SFPO's slow-fast update.

    Args:
        model_path: saved HF model directory.
        sfpo_inner_steps: K fast updates per batch (official 3).
        sfpo_alpha: reposition step size alpha in (0, 1] (official 0.8).
        sfpo_zscore_window: W entropies of the switch-off z-score (official 30).
        sfpo_zscore_threshold: switch SFPO off for good when z >= this (official 1.0).
        **kwargs: every :class:`GRPOModule` setting.
    """

    checkpointed_state = (("sfpo_switch", "sfpo_switch"),)

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
        require(sfpo_inner_steps >= 1, f"sfpo_inner_steps (K) must be >= 1, got {sfpo_inner_steps}")
        require(0 < sfpo_alpha <= 1, f"sfpo_alpha must be in (0, 1], got {sfpo_alpha}")
        require(sfpo_zscore_window >= 2, f"sfpo_zscore_window must be >= 2, got {sfpo_zscore_window}")
        super().__init__(model_path, **kwargs)
        self.sfpo_switch = EntropyZScoreSwitch(sfpo_zscore_window, sfpo_zscore_threshold)

    def update_policy(
        self,
        rollout: Rollout,
        advantages: Tensor,
        old_log_probs: Tensor | None,
        ref_log_probs: Tensor | None,
        *,
        minibatch_size: int,
        micro_size: int,
        step: int,
    ) -> list[dict[str, float]]:
        h = self.hparams
        active = self.sfpo_switch.check()
        plain = super().update_policy
        if active:
            if old_log_probs is None:  # pi_old must stay theta_0's over the fast and slow updates
                old_log_probs = self._log_probs_no_grad(self.model, rollout, micro_size)

            def one_update() -> list[dict[str, float]]:
                return plain(rollout, advantages, old_log_probs, ref_log_probs,
                             minibatch_size=minibatch_size, micro_size=micro_size, step=step)

            stats = slow_fast_update(self.model.parameters(), one_update,
                                     inner_steps=h.sfpo_inner_steps, alpha=h.sfpo_alpha)
        else:
            stats = plain(rollout, advantages, old_log_probs, ref_log_probs,
                          minibatch_size=minibatch_size, micro_size=micro_size, step=step)
        entropies = [s["entropy"] for s in stats if "entropy" in s]
        if entropies:
            self.sfpo_switch.record(sum(entropies) / len(entropies))
        extra = sfpo_metrics(active, self.sfpo_switch)
        return [{**s, **extra} for s in stats] or [extra]
