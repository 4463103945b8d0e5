"""GCPO: Group Contrastive Policy Optimization (GeometryZero, arXiv 2506.07160).

GRPO whose reward credits auxiliary constructions only where they help:

1. Roll out G completions per prompt (paper 8).
2. Per rollout: R_acc in {0, 1}, R_fmt in {0, 0.5}, R_aux = 0.5 when the detector finds an
   auxiliary construction (default: a ``<auxiliary>...</auxiliary>`` block), and
   R_len = 0.5 min(T, 900) / 900 with T the completion's token count.
3. Group contrastive mask per prompt: M = +1 / -1 / 0 from the accuracy gap between rollouts
   with and without the construction (eps 0.05; 0 when a side is empty).
4. R = R_acc + R_fmt + M R_aux + R_len, group-normalised (GRPO), then the usual update
   (no reference KL in the authors' runs).

Rewards and mask: ``mmpo.rewards.gcpo``; the synthetic task: ``mmpo.data.geometry_aux``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import mmpo.data.geometry_aux  # noqa: F401  (registers the geometry_aux task)
from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import LossConfig, SamplingConfig, as_config
from mmpo.rewards import compute_rewards
from mmpo.rewards.gcpo import gcpo_total_reward, get_aux_detector, group_contrastive_mask, gcpo_length_reward, uses_auxiliary
from mmpo.vlm.rollout import Rollout


class GCPOModule(GRPOModule):
    """GCPO (arXiv 2506.07160) on top of :class:`~mmpo.algos.grpo.GRPOModule`.

    Args:
        model_path: saved HF model directory.
        contrastive_eps: margin eps of the group contrastive mask (paper 0.05).
        contrastive_mask: False gives the unmasked aux reward (ToRL-style ablation).
        accuracy_weight: R_acc scale (1.0).
        format_weight: R_fmt scale (0.5).
        aux_weight: R_aux scale (0.5).
        length_cap: T at which R_len saturates (900).
        length_scale: R_len at the cap (0.5; 0 disables the length reward).
        aux_detector: a name in ``mmpo.rewards.gcpo.AUX_DETECTORS`` (``tag``, ``keywords``) or
            ``module:function`` taking the completion text and returning a bool.
        sampling: G 8 by default (authors' scripts).
        loss: reference KL coefficient ``beta`` 0 by default (authors).
        **kwargs: every other :class:`GRPOModule` setting (``reward_weights`` is not used).
    """

    def __init__(
        self,
        model_path: str,
        *,
        contrastive_eps: float = 0.05,
        contrastive_mask: bool = True,
        accuracy_weight: float = 1.0,
        format_weight: float = 0.5,
        aux_weight: float = 0.5,
        length_cap: int = 900,
        length_scale: float = 0.5,
        aux_detector: str = "tag",
        sampling: SamplingConfig = SamplingConfig(num_generations=8),
        loss: LossConfig = LossConfig(beta=0.0),
        **kwargs: Any,
    ) -> None:
        require(contrastive_eps >= 0, f"contrastive_eps must be >= 0, got {contrastive_eps}")
        require(length_cap >= 1, f"length_cap must be >= 1, got {length_cap}")
        detector = get_aux_detector(aux_detector)  # an unknown name fails before the model load
        super().__init__(model_path, sampling=as_config(sampling, SamplingConfig(num_generations=8)),
                         loss=as_config(loss, LossConfig(beta=0.0)), **kwargs)
        self.aux_detector = detector

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        # R_acc and R_fmt through the shared, time-limited reward runner
        _, per_fn, metrics = compute_rewards(
            {"accuracy": 1.0, "format": 1.0}, rollout.texts, rollout.rows, timeout_s=self.rewards.timeout_s
        )
        accuracy = per_fn["accuracy"]
        uses_aux = uses_auxiliary(rollout.texts, self.aux_detector)
        aux = h.aux_weight * uses_aux.float()
        length = gcpo_length_reward(rollout.completion_mask.sum(-1), cap=h.length_cap, scale=h.length_scale)
        if h.contrastive_mask:
            mask, mask_metrics = group_contrastive_mask(accuracy, uses_aux, rollout.group_ids, eps=h.contrastive_eps)
        else:
            mask, mask_metrics = aux.new_ones(aux.shape), {"gcpo/aux_rollout_frac": float(uses_aux.float().mean())}
        total = gcpo_total_reward(h.accuracy_weight * accuracy, h.format_weight * per_fn["format"], aux, length, mask)
        metrics.update(mask_metrics)
        metrics["rewards/gcpo_length/mean"] = float(length.mean())
        metrics["rewards/gcpo_aux_masked/mean"] = float((mask * aux).mean())
        if any("aux_helps" in row for row in rollout.rows):
            helps = [bool(row.get("aux_helps")) for row in rollout.rows]
            for flag, name in ((True, "helps"), (False, "not_helps")):
                picked = [float(u) for u, hlp in zip(uses_aux.tolist(), helps) if hlp is flag]
                if picked:
                    metrics[f"gcpo/aux_rate_{name}"] = sum(picked) / len(picked)
        return total, metrics
