"""HAPO: Heterogeneous Adaptive Policy Optimization (arXiv 2509.16591; official code ``starriver030515/HAPO``).

GRPOModule with HAPO's four pieces (``mmpo.core.hapo``):

1. rollout: per-token temperature T_t = T (1 + tau clamp(h^_t, -1, 1)) (a logits processor before
   the temperature warper); h^_t normalises the token's entropy with the previous step's statistics
   (none on the first step: plain T). Log-probs at update time use the fixed T, as the official
   trainer recomputes them with its config temperature;
2. advantage ``hapo``: token-level (length-weighted) group statistics, GRPO fallback when any |A| >= 5;
3. loss ``hapo``: asymmetric adaptive clip and differential advantage redistribution from h^ of the
   update's own entropies (GRPOModule passes them), PPO clip with dual clip c = 10, token-mean.

The statistics for the next rollout are those of all masked-in update entropies of the step (saved in
checkpoints). Official defaults (``recipe/*.sh``): tau 0.05, pivot 0.8, clip_alpha 1, adv_beta 1,
eps 0.2 / 0.2, c 10, G 16, no KL; the official code's sign of h^ for low-entropy tokens is kept
(``hapo_signed_entropy: false``; docs/variants/hapo.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from transformers import LogitsProcessor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, LossConfig, as_config
from mmpo.training.step_state import StepState
from mmpo.core import LossParts
from mmpo.core.hapo import EntropyNormStats, adaptive_temperature, hapo_entropy_norm, hapo_module_loss_settings
from mmpo.core.logprobs import entropy_from_logits
from mmpo.training.state_hooks import CheckpointedState
from mmpo.vlm.rollout import Rollout


class AdaptiveTemperatureProcessor(LogitsProcessor):
    """Divides each row's logits by 1 + tau clamp(h^, -1, 1), h^ from the entropy of softmax(logits / T);
    HF's temperature warper then divides by T, so the token is drawn at T_t = T (1 + tau clamp(h^, -1, 1))."""

    def __init__(self, stats: EntropyNormStats, *, tau: float, temperature: float, signed: bool) -> None:
        self.stats, self.tau, self.temperature, self.signed = stats, tau, temperature, signed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # suppressed tokens (vision specials, bad words) arrive as -inf: their 0 x -inf would make the entropy
        # NaN, so they enter as -1e30 (still finite after / T), whose probability is exactly 0 all the same
        entropy = entropy_from_logits(scores.float().clamp(min=-1e30) / self.temperature)
        h_hat = self.stats.normalise(entropy, signed=self.signed)
        factor = adaptive_temperature(self.temperature, h_hat, self.tau) / self.temperature
        return (scores.float() / factor.unsqueeze(-1)).to(scores.dtype)


class EntropyStatsState:
    """The previous step's h^ statistics (None before the first step), checkpointable."""

    def __init__(self) -> None:
        self.stats: EntropyNormStats | None = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.stats is None else dict(vars(self.stats))

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.stats = EntropyNormStats(**state) if state else None


HAPO_LOSS = LossConfig(name="hapo", dual_clip=10.0, clip_low=0.2, clip_high=0.2)


class HAPOModule(CheckpointedState, GRPOModule):
    """GRPO with HAPO's adaptive temperature, token-level advantage, adaptive clip and advantage redistribution.

    Args:
        model_path: saved HF model directory.
        hapo_tau: tau of the adaptive temperature (official 0.05; 0 disables it).
        hapo_entropy_pivot: quantile of log-entropy used as the pivot (official 0.8).
        hapo_clip_alpha: alpha of the adaptive clip (official 1.0).
        hapo_adv_beta: beta of the advantage redistribution (official 1.0).
        hapo_signed_entropy: keep h^ negative for low-entropy tokens (the paper's intent, UNVERIFIED);
            false = the official code, where h^ >= 0 for every token.
        advantage, loss: HAPO's by default (advantage ``hapo``; loss ``hapo`` with dual_clip 10, clip_low 0.2,
            clip_high 0.2); the ``hapo`` loss gets the hapo_* options under ``loss.settings``.
        **kwargs: every :class:`GRPOModule` setting.

    Metrics: ``hapo/temperature_mean`` (T (1 + tau clamp(h^)) averaged over the step's update tokens, with
    the statistics the next rollout samples with), ``hapo/entropy_pivot`` (the log-entropy pivot m),
    ``policy/hapo_high_entropy`` (share of tokens with h^ > 0), ``advantages/hapo_fallback_groups``.
    """

    checkpointed_state = (("hapo_entropy_stats", "entropy_stats"),)

    def __init__(
        self,
        model_path: str,
        *,
        hapo_tau: float = 0.05,
        hapo_entropy_pivot: float = 0.8,
        hapo_clip_alpha: float = 1.0,
        hapo_adv_beta: float = 1.0,
        hapo_signed_entropy: bool = False,
        advantage: AdvantageConfig = AdvantageConfig(name="hapo"),
        loss: LossConfig = HAPO_LOSS,
        **kwargs: Any,
    ) -> None:
        require(hapo_tau >= 0, f"hapo_tau must be >= 0, got {hapo_tau}")
        loss = as_config(loss, HAPO_LOSS)
        settings = hapo_module_loss_settings(loss.name, loss.settings, entropy_pivot=hapo_entropy_pivot,
                                             clip_alpha=hapo_clip_alpha, adv_beta=hapo_adv_beta,
                                             signed_entropy=hapo_signed_entropy)
        super().__init__(model_path, advantage=as_config(advantage, AdvantageConfig(name="hapo")),
                         loss=dataclasses.replace(loss, settings=settings), **kwargs)
        self.entropy_stats = EntropyStatsState()

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        h = self.hparams
        stats = self.entropy_stats.stats
        if h.hapo_tau == 0 or stats is None:  # first step: no statistics yet, plain temperature
            return super().build_rollout(rows)
        processor = AdaptiveTemperatureProcessor(stats, tau=h.hapo_tau, temperature=self.sampling.temperature,
                                                 signed=h.hapo_signed_entropy)
        return self.engine.generate(
            rows, num_samples=self.sampling.num_generations, max_new_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p, do_sample=True, logits_processors=[processor], **self._engine_log_prob_request(),
        )

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        mask = outputs["mask"] > 0
        outputs["step"].collect("hapo/entropy", outputs["entropy"].detach()[mask].float().cpu())
        return LossParts(), {}

    def end_step(self, state: StepState) -> None:
        """The step's update-time entropies become the statistics of the next rollout's temperature."""
        collected = state.collected("hapo/entropy")
        if not collected:
            return
        entropies = torch.cat(collected).unsqueeze(0)
        h_hat, stats = hapo_entropy_norm(entropies, torch.ones_like(entropies),
                                         pivot_quantile=self.hparams.hapo_entropy_pivot,
                                         signed=self.hparams.hapo_signed_entropy)
        self.entropy_stats.stats = stats
        temperature = adaptive_temperature(self.sampling.temperature, h_hat, self.hparams.hapo_tau)
        state.metrics.update({"hapo/temperature_mean": float(temperature.mean()), "hapo/entropy_pivot": stats.pivot})
