"""EPO: Entropy-regularized Policy Optimization (arXiv 2509.22576; official code ``WujiangXu/EPO``).

GRPO plus EPO's two entropy terms (``mmpo.core.entropy_reg``):

    loss = policy - lambda_H * (H - kappa * w(e) * P)

- H: the token-mean policy entropy (GRPOModule's ``entropy`` part, coefficient -lambda_H = -entropy_coef);
- P: ``out_range_penalty`` on every token (or sequence) whose entropy leaves
  (kappa_l * H_hist, kappa_r * H_hist), 0 inside; H_hist = the mean of the past steps' token-mean
  entropies (trainer state, saved in checkpoints); logged as the part ``losses/epo_smooth``;
- w(e): the optional phase weight of the official code (``epo_phase_weights``; e = trainer epoch, E = 150).

Faithful to the released code, P is a constant per token, so it changes the loss value but not its
gradient; the paper's differentiable smoothing term is UNVERIFIED. The official penalty applies only
to agent turns >= max_step // 2; a VLM rollout is one turn (turn 0), which that gate would switch off
for good, so here it applies from the first step that has a history (docs/variants/epo.md).
"""

from __future__ import annotations

from typing import Any, Mapping

from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import LossConfig, as_config
from mmpo.core import LossParts
from mmpo.vlm.rollout import Rollout
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.training.variants import EntropySmoothing


class EPOModule(CheckpointedState, GRPOModule):
    """GRPO with EPO's entropy bonus and historical-entropy smoothing penalty.

    Args:
        model_path: saved HF model directory.
        loss: GRPO's loss; its ``entropy_coef`` is lambda_H, the entropy bonus coefficient (official ``entropy_coeff``
            0.001 by default).
        epo_smooth_coef: kappa, the weight of the smoothing penalty inside the bonus (official 1.0).
        epo_min_ratio, epo_max_ratio: kappa_l, kappa_r: the band around H_hist (official 0.5, 1.5).
        epo_penalty: P outside the band (official ``out_range_penalty`` 0.1).
        epo_mask_mode: ``token`` (official default) or ``seq``.
        epo_phase_weights: multiply P by the phase weight w(epoch) (official default off).
        epo_phase_epochs: E of the phase weight (official 150).
        **kwargs: every :class:`GRPOModule` setting.

    Metrics: ``epo/history_mean`` (H_hist, 0 before any history), ``epo/within_frac``,
    ``epo/phase_weight``, ``losses/epo_smooth``.
    """

    checkpointed_state = (("epo_entropy_history", "epo"),)

    def __init__(
        self,
        model_path: str,
        *,
        loss: LossConfig = LossConfig(entropy_coef=0.001),
        epo_smooth_coef: float = 1.0,
        epo_min_ratio: float = 0.5,
        epo_max_ratio: float = 1.5,
        epo_penalty: float = 0.1,
        epo_mask_mode: str = "token",
        epo_phase_weights: bool = False,
        epo_phase_epochs: int = 150,
        **kwargs: Any,
    ) -> None:
        loss = as_config(loss, LossConfig(entropy_coef=0.001))
        epo = EntropySmoothing(loss.entropy_coef, epo_smooth_coef, epo_min_ratio, epo_max_ratio, epo_penalty,
                               epo_mask_mode, epo_phase_weights, epo_phase_epochs)
        super().__init__(model_path, loss=loss, **kwargs)
        self.epo = epo
        self.entropy_history = epo.history  # H_hist (the same object)

    def extra_loss_terms(
        self, minibatch: Rollout, outputs: Mapping[str, Any]
    ) -> tuple[LossParts, dict[str, Any]]:
        # loss = policy - lambda_H * H + lambda_H * kappa * w * P (the H part is GRPOModule's "entropy")
        epoch = 0 if self._trainer is None else self.current_epoch
        return self.epo.terms(outputs["entropy"], outputs["mask"], outputs["aggregation"], epoch=epoch, bonus=False,
                              step=outputs.get("step"))

    def end_step(self, state: StepState) -> None:
        self.epo.end_step(state, lambda value: self._sum_over_ranks(value.to(self.device)))
