"""Update-level variants, written once against the update engine and used by every family.

* :class:`SlowFastUpdate`: SFPO (arXiv 2510.04072; official code ``Urheen/SFPO``) wraps a whole
  update pass: K fast passes, a reposition theta_0 + alpha (theta_K - theta_0), one slow pass
  (``mmpo.core.slow_fast``), with the official entropy z-score switch-off. The VLM modules
  (``mmpo.algos.sfpo``), the masked-diffusion LM (``mmpo.dllm.variants``) and DPPO
  (``mmpo.robotics.sfpo``) attach the same object; they differ only in what they report as the
  pass's entropy.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

from torch import Tensor

from mmpo.core.slow_fast import EntropyZScoreSwitch, slow_fast_update
from mmpo.training.update import PassContext, UpdateWrapper


class SlowFastUpdate(UpdateWrapper):
    """SFPO's slow-fast update of one pass.

    Every pass makes its ordinary optimizer steps, so a batch makes (K + 1) x the plain batch's steps;
    ``trainer.max_steps`` and the LR schedule count all of them (the official code steps its scheduler
    per optimizer step too). pi_old stays the rollout policy's over the K + 1 passes
    (``PassContext.ensure_old_log_probs``).

    Args:
        inner_steps: K fast passes (official 3).
        alpha: reposition step size in (0, 1] (official 0.8); 1 keeps the fast weights.
        zscore_window: W entropies of the switch-off z-score (official 30); None = no switch (always on:
            DPPO's policies report no token entropy).
        zscore_threshold: switch SFPO off for good when z >= this (official 1.0).
    """

    def __init__(self, inner_steps: int = 3, alpha: float = 0.8, zscore_window: int | None = 30,
                 zscore_threshold: float = 1.0) -> None:
        if inner_steps < 1:
            raise ValueError(f"sfpo_inner_steps (K) must be >= 1, got {inner_steps}")
        if not 0 < alpha <= 1:
            raise ValueError(f"sfpo_alpha must be in (0, 1], got {alpha}")
        if zscore_window is not None and zscore_window < 2:
            raise ValueError(f"sfpo_zscore_window must be >= 2, got {zscore_window}")
        self.inner_steps = inner_steps
        self.alpha = alpha
        self.switch = None if zscore_window is None else EntropyZScoreSwitch(zscore_window, zscore_threshold)

    def metrics(self, active: bool) -> dict[str, float]:
        """``sfpo/active`` (1 while SFPO runs) and, once W entropies are recorded, ``sfpo/entropy_zscore``."""
        metrics = {"sfpo/active": float(active)}
        if self.switch is not None and not math.isnan(self.switch.last_z):
            metrics["sfpo/entropy_zscore"] = self.switch.last_z
        return metrics

    def wrap(self, plain: Callable[[], list[dict[str, float]]], parameters: Callable[[], Iterable[Tensor]],
             context: PassContext) -> list[dict[str, float]]:
        if not context.trains_actor:  # critic warm-up: the actor does not move, nothing to reposition
            return plain()
        active = self.switch.check() if self.switch is not None else True
        if active:
            context.ensure_old_log_probs()
            stats = slow_fast_update(parameters(), plain, inner_steps=self.inner_steps, alpha=self.alpha)
        else:
            stats = plain()
        if self.switch is not None:
            entropy = context.mean_entropy(stats)
            if entropy is not None:
                self.switch.record(entropy)
        extra = self.metrics(active)
        return [{**s, **extra} for s in stats] or [extra]

    def state_dict(self) -> dict[str, Any]:
        return {} if self.switch is None else self.switch.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.switch is not None:
            self.switch.load_state_dict(state)
