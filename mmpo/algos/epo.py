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

import torch

from mmpo.algos.grpo import GRPOModule
from mmpo.core import LossParts
from mmpo.core.entropy_reg import EntropyHistory, check_epo_settings, epo_phase_weight, epo_smoothing_penalty
from mmpo.vlm.rollout import Rollout
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState


class EPOModule(CheckpointedState, GRPOModule):
    """GRPO with EPO's entropy bonus and historical-entropy smoothing penalty.

    Args:
        model_path: saved HF model directory.
        entropy_coef: lambda_H, the entropy bonus coefficient (official ``entropy_coeff`` 0.001).
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

    checkpointed_state = (("epo_entropy_history", "entropy_history"),)

    def __init__(
        self,
        model_path: str,
        *,
        entropy_coef: float = 0.001,
        epo_smooth_coef: float = 1.0,
        epo_min_ratio: float = 0.5,
        epo_max_ratio: float = 1.5,
        epo_penalty: float = 0.1,
        epo_mask_mode: str = "token",
        epo_phase_weights: bool = False,
        epo_phase_epochs: int = 150,
        **kwargs: Any,
    ) -> None:
        check_epo_settings(entropy_coef=entropy_coef, epo_smooth_coef=epo_smooth_coef, epo_min_ratio=epo_min_ratio,
                           epo_max_ratio=epo_max_ratio, epo_penalty=epo_penalty, epo_mask_mode=epo_mask_mode,
                           epo_phase_epochs=epo_phase_epochs)
        super().__init__(model_path, entropy_coef=entropy_coef, **kwargs)
        self.entropy_history = EntropyHistory()

    def phase_weight(self) -> float:
        h = self.hparams
        epoch = 0 if self._trainer is None else self.current_epoch
        return epo_phase_weight(epoch, h.epo_phase_epochs) if h.epo_phase_weights else 1.0

    def extra_loss_terms(
        self, minibatch: Rollout, outputs: Mapping[str, Any]
    ) -> tuple[LossParts, dict[str, Any]]:
        h = self.hparams
        entropy, mask = outputs["entropy"], outputs["mask"]
        with torch.no_grad():  # this micro-batch's token entropy sum and token count, for end_step's history
            outputs["step"].collect("epo/entropy", (float((entropy.detach() * mask).sum()), float(mask.sum())))
        history = self.entropy_history.mean  # None on the first step: no history, no penalty
        penalty, within = epo_smoothing_penalty(
            entropy, mask, history, min_ratio=h.epo_min_ratio, max_ratio=h.epo_max_ratio,
            penalty=h.epo_penalty, mode=h.epo_mask_mode)
        weight = self.phase_weight()
        # loss = policy - lambda_H * H + lambda_H * kappa * w * P (the H part is GRPOModule's "entropy")
        parts = LossParts().add("epo_smooth", outputs["aggregation"](penalty * weight, mask), h.entropy_coef * h.epo_smooth_coef)
        metrics = {"epo/within_frac": within, "epo/history_mean": history or 0.0, "epo/phase_weight": weight}
        return parts, metrics

    def end_step(self, state: StepState) -> None:
        """The step's token-mean entropy (over every rank's tokens) joins the history."""
        sums = state.collected("epo/entropy")
        step_entropy = [sum(total for total, _ in sums), sum(count for _, count in sums)]
        total, count = (float(self._sum_over_ranks(torch.tensor(v, dtype=torch.float64, device=self.device)))
                        for v in step_entropy)
        if count > 0:
            self.entropy_history.update(total / count)
