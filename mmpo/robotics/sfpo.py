"""SFPO (arXiv 2510.04072) around DPPO's update: slow-fast for a diffusion robot policy.

``SFPODPPOModule`` attaches the shared :class:`~mmpo.training.variants.SlowFastUpdate` (the same object
the VLM and masked-diffusion modules use) to DPPO's update pass: K fast
passes of ``optim.mu`` epochs over the rollout, reposition of the fine-tuned actor network to
theta_0 + alpha (theta_K - theta_0), one slow pass. The old log-probs are the rollout's, fixed to
theta_0. The critic is trained in every pass and not repositioned (SFPO's official code has no
critic; this choice is this project's). SFPO's entropy switch is left out here: a Gaussian
denoising step's entropy is set by its std schedule, not learned, so its z-score carries no signal
(docs/variants/sfpo.md). During the critic warm-up iterations the update is the plain one.
"""

from __future__ import annotations

from typing import Any

from mmpo.robotics.dppo import DPPOModule
from mmpo.training.variants import SlowFastUpdate


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
        # no entropy switch: the denoising chain reports no token entropy (SFPO runs on every actor update)
        wrapper = SlowFastUpdate(sfpo_inner_steps, sfpo_alpha, zscore_window=None)
        super().__init__(bc_checkpoint, *args, **kwargs)
        self.update_wrapper = wrapper
