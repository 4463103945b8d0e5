"""SFPO (arXiv 2510.04072) around DPPO's update: slow-fast for a diffusion robot policy.

``SFPODPPOModule.ppo_update`` runs ``mmpo.core.slow_fast_update`` over DPPO's own update: K fast
passes of ``update_epochs`` over the rollout, reposition of the fine-tuned actor network to
theta_0 + alpha (theta_K - theta_0), one slow pass. The old log-probs are the rollout's, fixed to
theta_0. The critic is trained in every pass and not repositioned (SFPO's official code has no
critic; this choice is this project's). SFPO's entropy switch is left out here: a Gaussian
denoising step's entropy is set by its std schedule, not learned, so its z-score carries no signal
(docs/variants/sfpo.md). During the critic warm-up iterations the update is the plain one.
"""

from __future__ import annotations

from typing import Any

from mmpo.core.slow_fast import slow_fast_update
from mmpo.robotics.dppo import DPPOModule, Rollout


class SFPODPPOModule(DPPOModule):
    """DPPO (arXiv 2409.00588) with SFPO's slow-fast update of the actor.

    Args:
        bc_checkpoint: the BC checkpoint DPPO fine-tunes.
        sfpo_inner_steps: K fast passes per iteration (official 3).
        sfpo_alpha: reposition step size in (0, 1] (official 0.8).
        **kwargs: every :class:`~mmpo.robotics.dppo.DPPOModule` setting.
    """

    def __init__(self, bc_checkpoint: str, *args: Any, sfpo_inner_steps: int = 3, sfpo_alpha: float = 0.8,
                 **kwargs: Any) -> None:
        if sfpo_inner_steps < 1:
            raise ValueError(f"sfpo_inner_steps (K) must be >= 1, got {sfpo_inner_steps}")
        if not 0 < sfpo_alpha <= 1:
            raise ValueError(f"sfpo_alpha must be in (0, 1], got {sfpo_alpha}")
        super().__init__(bc_checkpoint, *args, **kwargs)

    def ppo_update(self, rollout: Rollout, train_actor: bool) -> dict[str, float]:
        plain = super().ppo_update
        if not train_actor:  # critic warm-up: the actor does not move, so there is nothing to reposition
            return plain(rollout, train_actor)
        hp = self.hparams
        metrics = slow_fast_update(self.policy.ft_network.parameters(), lambda: plain(rollout, train_actor),
                                   inner_steps=hp.sfpo_inner_steps, alpha=hp.sfpo_alpha)
        return {**metrics, "sfpo/active": 1.0}
