"""Update-level variants, written once against the update engine and used by every family.

* :class:`SlowFastUpdate`: SFPO (arXiv 2510.04072; official code ``Urheen/SFPO``) wraps a whole
  update pass: K fast passes, a reposition theta_0 + alpha (theta_K - theta_0), one slow pass
  (``mmpo.core.slow_fast``), with the official entropy z-score switch-off. The VLM modules
  (``mmpo.algos.sfpo``), the masked-diffusion LM (``mmpo.dllm.variants``) and DPPO
  (``mmpo.robotics.sfpo``) attach the same object; they differ only in what they report as the
  pass's entropy.
* :class:`LengthBands`: LSPO's length-band group filter (VLM and masked-diffusion modules).
* :class:`EntropySmoothing`: EPO's entropy bonus and historical-entropy smoothing penalty (VLM and
  masked-diffusion modules), its history checkpointed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from mmpo.core import LossParts, lspo_filter
from mmpo.core.entropy_reg import EntropyHistory, check_epo_settings, epo_phase_weight, epo_smoothing_penalty
from mmpo.core.slow_fast import EntropyZScoreSwitch, slow_fast_update
from mmpo.training.step_state import StepState
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


class LengthBands:
    """LSPO's length-band group filter (arXiv 2510.01459, ``mmpo.core.lspo_filter``), for every family whose
    samples have a length (VLM / text completions, masked-diffusion completions).

    Args:
        low, high, max_quantile: the band quantiles: keep L <= Q(low) or Q(high) <= L <= Q(max_quantile)
            (this project's reading 0.3 / 0.65 / 0.95; UNVERIFIED, docs/variants/lspo.md).
    """

    def __init__(self, low: float = 0.3, high: float = 0.65, max_quantile: float = 0.95) -> None:
        if not 0.0 <= low <= high <= max_quantile <= 1.0:
            raise ValueError(f"LSPO needs 0 <= lspo_low <= lspo_high <= lspo_max <= 1, got {low}, {high}, {max_quantile}")
        self.low, self.high, self.max_quantile = low, high, max_quantile

    def __call__(self, lengths: Tensor, group_ids: Tensor, candidates: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """``(N,)`` keep mask of the groups in a band (among ``candidates``, the zero-variance filter's keep mask,
        or all) and the metrics ``lspo/dropped_groups``, ``lspo/kept_frac`` (share of the batch's groups kept)."""
        kept = lspo_filter(lengths, group_ids, candidates, low=self.low, high=self.high, max_quantile=self.max_quantile)
        kept_groups = group_ids[kept.keep_mask.to(group_ids.device)].unique().numel()
        return kept.keep_mask, {"lspo/dropped_groups": float(kept.num_dropped),
                                "lspo/kept_frac": kept_groups / group_ids.unique().numel()}


class EntropySmoothing:
    """EPO's entropy terms (arXiv 2509.22576; official code ``WujiangXu/EPO``) for every family:

        loss = ... - lambda_H * (H - kappa * w(e) * P)

    H: the update-time entropy (the VLM modules' own ``entropy`` part, or added here with ``bonus``); P:
    ``out_range_penalty`` on every token (or sequence) whose entropy leaves (kappa_l H_hist, kappa_r H_hist),
    H_hist the mean of the past steps' token-mean entropies (``history``, checkpointed); w(e) the optional
    phase weight. As the released code, P is a constant per token (it changes the loss, not its gradient).

    Args: entropy_coef (lambda_H, official 0.001), smooth_coef (kappa, 1.0), min_ratio / max_ratio (0.5 / 1.5),
        penalty (0.1), mask_mode (``token`` or ``seq``), phase_weights (off), phase_epochs (E, 150).
    """

    def __init__(self, entropy_coef: float = 0.001, smooth_coef: float = 1.0, min_ratio: float = 0.5,
                 max_ratio: float = 1.5, penalty: float = 0.1, mask_mode: str = "token", phase_weights: bool = False,
                 phase_epochs: int = 150) -> None:
        check_epo_settings(entropy_coef=entropy_coef, epo_smooth_coef=smooth_coef, epo_min_ratio=min_ratio,
                           epo_max_ratio=max_ratio, epo_penalty=penalty, epo_mask_mode=mask_mode,
                           epo_phase_epochs=phase_epochs)
        self.entropy_coef, self.smooth_coef = entropy_coef, smooth_coef
        self.min_ratio, self.max_ratio, self.penalty, self.mask_mode = min_ratio, max_ratio, penalty, mask_mode
        self.phase_weights, self.phase_epochs = phase_weights, phase_epochs
        self.history = EntropyHistory()

    def phase_weight(self, epoch: int) -> float:
        return epo_phase_weight(epoch, self.phase_epochs) if self.phase_weights else 1.0

    def terms(self, entropy: Tensor, mask: Tensor, aggregation: Callable[[Tensor, Tensor], Tensor], *, epoch: int,
              bonus: bool, step: StepState | None = None) -> tuple[LossParts, dict[str, float]]:
        """The parts (``entropy`` when ``bonus``, ``epo_smooth``) of one micro-batch, aggregated like the policy loss,
        and the metrics ``epo/within_frac``, ``epo/history_mean`` (0 before any history), ``epo/phase_weight``
        (and ``entropy``, the token mean, with ``bonus``);
        the micro-batch's entropy sum and token count are collected on ``step`` for :meth:`end_step`."""
        with torch.no_grad():
            token_sum, tokens = float((entropy.detach() * mask).sum()), float(mask.sum())
        if step is not None:
            step.collect("epo/entropy", (token_sum, tokens))
        history = self.history.mean  # None on the first step: no history, no penalty
        penalty, within = epo_smoothing_penalty(entropy, mask, history, min_ratio=self.min_ratio,
                                                max_ratio=self.max_ratio, penalty=self.penalty, mode=self.mask_mode)
        weight = self.phase_weight(epoch)
        parts = LossParts()
        if bonus:
            parts.add("entropy", aggregation(entropy, mask), -self.entropy_coef)
        parts.add("epo_smooth", aggregation(penalty * weight, mask), self.entropy_coef * self.smooth_coef)
        metrics = {"epo/within_frac": within, "epo/history_mean": history or 0.0, "epo/phase_weight": weight}
        if bonus:  # the VLM modules log their own entropy part and metric
            metrics["entropy"] = token_sum / max(tokens, 1.0)
        return parts, metrics

    def end_step(self, step: StepState, sum_over_ranks: Callable[[Tensor], Tensor]) -> None:
        """The step's token-mean entropy (over every rank's tokens) joins the history."""
        sums = step.collected("epo/entropy")
        total, count = (float(sum_over_ranks(torch.tensor(v, dtype=torch.float64)))
                        for v in (sum(s for s, _ in sums), sum(c for _, c in sums)))
        if count > 0:
            self.history.update(total / count)

    def state_dict(self) -> dict[str, Any]:
        return self.history.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history.load_state_dict(state)
