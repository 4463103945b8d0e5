"""GRPO-family variants on the masked-diffusion module, through DiffuGRPO's two hooks.

- :class:`LSPODiffuGRPO`: LSPO's length-band filter (arXiv 2510.01459, ``mmpo.core.lspo_filter``)
  after the zero-variance filter, on ``filter_groups``. A completion's length is its tokens before
  the first EOS (what ``decode_completions`` keeps), the whole ``gen_length`` when it has none.
- :class:`SFPODiffuGRPO`: SFPO's slow-fast update (arXiv 2510.04072, ``mmpo.core.slow_fast``) on
  ``update_policy``: K fast passes of the ``inner_updates`` steps, reposition, one slow pass; the old
  log-probs stay theta_0's. The entropy switch reads the token-mean entropy of theta_0 on the batch
  (the old-policy entropies this module computes anyway; the official code reads the update's
  entropy, which the default dLLM loss does not compute).
- :class:`EPODiffuGRPO`: EPO's entropy bonus and historical-entropy smoothing penalty (arXiv 2509.22576,
  ``mmpo.core.entropy_reg``) on ``extra_loss_terms``, with the entropy history checkpointed.
- :class:`HAPODiffuGRPO`: HAPO's advantage estimator and its adaptive-clip / advantage-redistribution loss
  (arXiv 2509.16591, ``mmpo.core.hapo``); the loss reads the update-time entropy. HAPO's adaptive rollout
  temperature is not wired into the block sampler.

The entropy both read is the mask predictor's: at each scored completion position (every position under
``masking: full``, the masked ones under ``structured``), the entropy of its distribution over the vocabulary
given the prompt and the visible completion tokens. The papers define it for autoregressive LMs (the
next-token distribution); that this transfers is UNVERIFIED (docs/variants/epo.md, docs/variants/hapo.md).

See docs/variants/lspo.md, sfpo.md, epo.md and hapo.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from mmpo.dllm.config import DIFFU_GRPO_ADVANTAGE, DIFFU_GRPO_LOSS
from mmpo.dllm.rl import DiffuGRPO
from mmpo.core import LossParts, aggregate, dynamic_sampling_filter
from mmpo.core.hapo import hapo_module_loss_settings
from mmpo.training.config import AdvantageConfig, LossConfig, as_config
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.training.variants import EntropySmoothing, LengthBands, SlowFastUpdate


# the variants' defaults over DiffuGRPO's (mmpo.dllm.config): EPO's lambda_H, HAPO's estimator and loss
EPO_LOSS = dataclasses.replace(DIFFU_GRPO_LOSS, entropy_coef=0.001)
HAPO_ADVANTAGE = dataclasses.replace(DIFFU_GRPO_ADVANTAGE, name="hapo")
HAPO_LOSS = dataclasses.replace(DIFFU_GRPO_LOSS, name="hapo")


def completion_lengths(completions: Tensor, eos_token_id: int) -> Tensor:
    """(N,) tokens before each row's first EOS (the row's width when it has none)."""
    width = completions.shape[1]
    is_eos = completions == eos_token_id
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.full_like(completions[:, 0], width))
    return first.to(torch.float32)


class LSPODiffuGRPO(DiffuGRPO):
    """DiffuGRPO / IGPO with LSPO's length bands (defaults as ``mmpo.algos.lspo.LSPOModule``; UNVERIFIED).

    Args:
        lspo_low, lspo_high, lspo_max: the band quantiles (keep L <= Q(low) or Q(high) <= L <= Q(max)).
        lspo_zero_variance: run the zero-variance filter first (the paper's order).
        **kwargs: every :class:`~mmpo.dllm.rl.DiffuGRPO` setting.
    """

    def __init__(self, *, lspo_low: float = 0.3, lspo_high: float = 0.65, lspo_max: float = 0.95,
                 lspo_zero_variance: bool = True, **kwargs: Any) -> None:
        bands = LengthBands(lspo_low, lspo_high, lspo_max)
        super().__init__(**kwargs)
        self.length_bands = bands

    def filter_groups(self, batch: dict) -> tuple[Tensor | None, dict[str, float]]:
        h = self.hparams
        rewards, group_ids = batch["rewards"], batch["group_ids"]
        metrics: dict[str, float] = {}
        candidates = None
        if h.lspo_zero_variance:
            zero_variance = dynamic_sampling_filter(rewards, group_ids)
            candidates = zero_variance.keep_mask
            metrics["rewards/dropped_groups"] = float(zero_variance.num_dropped)
        lengths = completion_lengths(batch["completions"], self.tokenizer.eos_token_id).to(rewards.device)
        keep, band_metrics = self.length_bands(lengths, group_ids, candidates)
        return keep, {**metrics, **band_metrics}


class SFPODiffuGRPO(CheckpointedState, DiffuGRPO):
    """DiffuGRPO / IGPO whose update is SFPO's slow-fast update (official defaults K 3, alpha 0.8, W 30, z 1.0),
    the same :class:`~mmpo.training.variants.SlowFastUpdate` as the VLM and DPPO modules.

    Every pass makes ``inner_updates`` optimizer steps, so a batch makes (K + 1) x ``inner_updates``;
    ``trainer.max_steps`` counts all of them. The switch state is saved in checkpoints.
    """

    checkpointed_state = (("sfpo_switch", "update_wrapper"),)

    def __init__(self, *, sfpo_inner_steps: int = 3, sfpo_alpha: float = 0.8, sfpo_zscore_window: int = 30,
                 sfpo_zscore_threshold: float = 1.0, **kwargs: Any) -> None:
        wrapper = SlowFastUpdate(sfpo_inner_steps, sfpo_alpha, sfpo_zscore_window, sfpo_zscore_threshold)
        super().__init__(**kwargs)
        self.update_wrapper = wrapper


class EPODiffuGRPO(CheckpointedState, DiffuGRPO):
    """DiffuGRPO / IGPO with EPO's entropy terms: loss = igpo_loss - lambda_H * (H - kappa * w(e) * P).

    H is the update-time entropy of the mask predictor (differentiable) aggregated like the policy loss
    (``loss.agg`` over the inner update's loss mask); P the out-of-band penalty against the mean of past
    steps' token-mean entropies H_hist (gradient-free, as the official code); both from ``mmpo.core.entropy_reg``.
    Defaults are the official script's (as ``mmpo.algos.epo.EPOModule``).

    Args:
        loss: DiffuGRPO's loss with ``entropy_coef`` lambda_H (official 0.001).
        epo_smooth_coef: kappa (official 1.0).
        epo_min_ratio, epo_max_ratio: the band (kappa_l H_hist, kappa_r H_hist) (official 0.5, 1.5).
        epo_penalty: P outside the band (official 0.1).
        epo_mask_mode: ``token`` (official) or ``seq``.
        epo_phase_weights, epo_phase_epochs: the optional phase weight w(trainer epoch), E (official off, 150).
        **kwargs: every :class:`~mmpo.dllm.rl.DiffuGRPO` setting.

    Metrics: ``losses/entropy`` (H), ``losses/epo_smooth`` (P aggregated), ``entropy`` (token mean over the
    loss mask), ``epo/history_mean`` (0 before any history), ``epo/within_frac``, ``epo/phase_weight``.
    The history is saved in checkpoints as ``epo_entropy_history``.
    """

    checkpointed_state = (("epo_entropy_history", "epo"),)
    entropy_in_loss = True

    def __init__(self, *, loss: LossConfig = EPO_LOSS, epo_smooth_coef: float = 1.0, epo_min_ratio: float = 0.5,
                 epo_max_ratio: float = 1.5, epo_penalty: float = 0.1, epo_mask_mode: str = "token",
                 epo_phase_weights: bool = False, epo_phase_epochs: int = 150, **kwargs: Any) -> None:
        loss = as_config(loss, EPO_LOSS)
        epo = EntropySmoothing(loss.entropy_coef, epo_smooth_coef, epo_min_ratio, epo_max_ratio, epo_penalty,
                               epo_mask_mode, epo_phase_weights, epo_phase_epochs)
        super().__init__(loss=loss, **kwargs)
        self.epo = epo
        self.entropy_history = epo.history  # H_hist (the same object)

    def extra_loss_terms(self, entropy: Tensor | None, loss_mask: Tensor,
                         state: StepState | None = None) -> tuple[LossParts, dict[str, Any]]:
        # loss = policy + beta KL - lambda_H * H + lambda_H * kappa * w * P, aggregated like the policy loss
        agg, norm_len = self.loss.agg, self.loss.norm_len
        epoch = 0 if self._trainer is None else self.current_epoch
        return self.epo.terms(entropy, loss_mask.to(entropy.dtype), lambda v, m: aggregate(v, m, agg, norm_len=norm_len),
                              epoch=epoch, bonus=True, step=state)

    def end_step(self, state: StepState) -> None:
        def sum_over_ranks(value: Tensor) -> Tensor:  # one history for all ranks
            if self._trainer is None or self.trainer.world_size == 1:
                return value
            return self.trainer.strategy.reduce(value.to(self.device), reduce_op="sum")

        self.epo.end_step(state, sum_over_ranks)


class HAPODiffuGRPO(DiffuGRPO):
    """DiffuGRPO / IGPO with HAPO's token-level advantage (``hapo``) and loss (``hapo``: asymmetric adaptive clip
    and differential advantage redistribution from h^ of the update-time entropies, PPO clip with dual clip c).

    The loss is token level (r_t = exp(l_t - l_old_t) of the one-pass estimator), takes ``clip_low`` /
    ``clip_high`` (HAPO 0.2 / 0.2) and sees the whole batch of each inner update (no micro-batches). Official
    defaults as ``mmpo.algos.hapo.HAPOModule``; the recipes use no KL (set ``beta: 0``). The adaptive rollout
    temperature is not implemented here (the block sampler has no per-position temperature).

    Args:
        hapo_entropy_pivot: quantile of log-entropy used as the pivot (official 0.8).
        hapo_clip_alpha: alpha of the adaptive clip (official 1.0).
        hapo_adv_beta: beta of the advantage redistribution (official 1.0).
        hapo_signed_entropy: keep h^ negative for low-entropy tokens (the paper's intent, UNVERIFIED);
            false = the official code, where h^ >= 0 for every token.
        hapo_dual_clip: the dual clip c (official 10; None disables).
        advantage, loss: HAPO's (``advantage.name`` hapo, ``loss.name`` hapo, DiffuGRPO's other fields); the
            ``hapo_*`` loss options apply only with ``loss.name: hapo``, under the user's ``loss.settings``.
        **kwargs: every :class:`~mmpo.dllm.rl.DiffuGRPO` setting.

    Metrics: ``policy/hapo_high_entropy`` (share of loss tokens with h^ > 0), ``policy/clipfrac_dual``,
    ``advantages/hapo_fallback_groups``.
    """

    def __init__(self, *, hapo_entropy_pivot: float = 0.8, hapo_clip_alpha: float = 1.0, hapo_adv_beta: float = 1.0,
                 hapo_signed_entropy: bool = False, hapo_dual_clip: float | None = 10.0,
                 advantage: AdvantageConfig = HAPO_ADVANTAGE, loss: LossConfig = HAPO_LOSS, **kwargs: Any) -> None:
        loss = as_config(loss, HAPO_LOSS)
        settings = hapo_module_loss_settings(loss.name, loss.settings, entropy_pivot=hapo_entropy_pivot,
                                             clip_alpha=hapo_clip_alpha, adv_beta=hapo_adv_beta,
                                             signed_entropy=hapo_signed_entropy, dual_clip=hapo_dual_clip)
        super().__init__(advantage=as_config(advantage, HAPO_ADVANTAGE), loss=dataclasses.replace(loss, settings=settings),
                         **kwargs)
