"""Segment Policy Optimization, chain form (Segment-PO, arXiv 2505.23564).

Official code: ``AIFrameResearch/SPO`` (``src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py``).
Per step:

1. sample G completions per prompt (the GRPO rollout);
2. log pi_old of each sampled token; cut points are the positions before every ``cutpoint_interval``-th
   token with probability < 0.9 (:func:`~mmpo.core.advantages_tree.segment_cut_points`);
3. V(cut) = the mean reward of ``mc_samples`` continuations sampled from ``prompt + completion[: cut + 1]``
   (identical prefixes of one prompt are estimated once, as the official code deduplicates queries);
   a continuation is cut at the completion's remaining token budget;
4. segment advantages V(cut_k) - V(cut_{k-1}) (estimator ``segment``), whitened over the kept tokens;
5. the probability mask: tokens with probability > 0.9 leave the loss (``extras["loss_mask"]``).

Not implemented: SPO-tree (the long-CoT tree variant); the official unfinished-response penalty
(a continuation that hits the budget is scored by the reward functions like any other text).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.core import compute_advantages_with_metrics
from mmpo.core.advantages_tree import SEGMENT_PROB_THRESHOLD, segment_cut_points, segment_probability_mask
from mmpo.vlm.continuation import extend_prompts, generate_from_inputs, join_completions
from mmpo.vlm.processing import select_rows
from mmpo.vlm.rollout import Rollout


class SegmentPOModule(GRPOModule):
    """GRPO with Segment-PO's Monte Carlo segment advantages and probability mask.

    Args:
        model_path: saved HF model directory.
        cutpoint_interval: keep every k-th low-probability position as a cut point (official 5; also 10).
        mc_samples: continuations per cut point (official 9).
        max_cut_points: optional cap on cut points per completion (the first ones); None = uncapped (official).
        mc_batch_size: continuations per ``generate`` call.
        segment_whiten: whiten the kept tokens' advantages over the batch.
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is fixed to ``segment``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        advantage: AdvantageConfig = AdvantageConfig(name="segment"),
        cutpoint_interval: int = 5,
        mc_samples: int = 9,
        max_cut_points: int | None = None,
        mc_batch_size: int = 64,
        segment_whiten: bool = True,
        **kwargs: Any,
    ) -> None:
        advantage = as_config(advantage, AdvantageConfig(name="segment"))
        require(advantage.name == "segment", "SegmentPOModule's advantage is 'segment'")
        super().__init__(model_path, advantage=advantage, **kwargs)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(h.cutpoint_interval >= 1, f"cutpoint_interval must be >= 1, got {h.cutpoint_interval}")
        require(h.mc_samples >= 1, f"mc_samples must be >= 1, got {h.mc_samples}")
        require(h.max_cut_points is None or h.max_cut_points >= 1,
                f"max_cut_points must be >= 1 or None, got {h.max_cut_points}")
        require(h.mc_batch_size >= 1, f"mc_batch_size must be >= 1, got {h.mc_batch_size}")

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """The GRPO rollout plus, in ``extras``, the Monte Carlo values of its cut points
        (``segment_values`` (N, T): V after token c at column c, NaN elsewhere; ``segment_query_values``
        (N,): V of the prompt state, NaN unless the first token is a cut), ``segment_log_probs`` and
        the probability mask ``loss_mask``."""
        rollout = super().build_rollout(rows)
        h = self.hparams
        log_probs = self._log_probs_no_grad(self.model, rollout.to(self.device),
                                            self.optim.micro_batch_size or len(rollout)).float().cpu()
        mask = rollout.completion_mask
        cuts = segment_cut_points(log_probs, mask, interval=h.cutpoint_interval)
        if h.max_cut_points is not None:
            cuts = [c[: h.max_cut_points] for c in cuts]
        values = torch.full(mask.shape, math.nan)
        query_values = torch.full((len(rollout),), math.nan)
        estimates = self._mc_values(rollout, cuts)
        for i, row_cuts in enumerate(cuts):
            for c in row_cuts:
                key = (int(rollout.group_ids[i]), tuple(rollout.completion_ids[i, : c + 1].tolist()))
                if c < 0:
                    query_values[i] = estimates[key]
                else:
                    values[i, c] = estimates[key]
        rollout.extras.update(segment_values=values, segment_query_values=query_values, segment_log_probs=log_probs,
                              loss_mask=segment_probability_mask(log_probs, mask).long())
        return rollout

    @torch.no_grad()
    def _mc_values(self, rollout: Rollout, cuts: list[list[int]]) -> dict[tuple[int, tuple[int, ...]], float]:
        """Mean reward of ``mc_samples`` continuations of each distinct (prompt, prefix)."""
        h = self.hparams
        first: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for i, row_cuts in enumerate(cuts):
            for c in row_cuts:
                first.setdefault((int(rollout.group_ids[i]), tuple(rollout.completion_ids[i, : c + 1].tolist())), (i, c))
        keys = list(first)
        jobs = [(k, first[k]) for k in keys for _ in range(h.mc_samples)]
        totals = dict.fromkeys(keys, 0.0)
        pad = self.engine.pad_token_id
        for start in range(0, len(jobs), h.mc_batch_size):
            chunk = jobs[start : start + h.mc_batch_size]
            index = [i for _, (i, _) in chunk]
            width = max(1, max(c + 1 for _, (_, c) in chunk))
            prefix = torch.full((len(chunk), width), pad, dtype=torch.long)
            prefix_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, (_, (i, c)) in enumerate(chunk):
                prefix[j, : c + 1] = rollout.completion_ids[i, : c + 1]
                prefix_mask[j, : c + 1] = 1
            prompts = extend_prompts(select_rows(rollout.prompt_inputs, index), prefix, prefix_mask, pad_token_id=pad)
            # a cut point lies before the last token (c + 1 < length <= max_new_tokens): budget >= 1
            budget = self.sampling.max_new_tokens - min(c + 1 for _, (_, c) in chunk)
            cont = generate_from_inputs(self.engine, [rollout.rows[i] for i in index], prompts, max_new_tokens=budget,
                                        temperature=self.sampling.temperature, top_p=self.sampling.top_p)
            # each continuation is cut at its own remaining budget (a shorter sample of the same process)
            cont_mask = cont.completion_mask.clone()
            for j, (_, (_, c)) in enumerate(chunk):
                cont_mask[j, max(0, self.sampling.max_new_tokens - (c + 1)):] = 0
            full_ids, _ = join_completions(prefix, prefix_mask, cont.completion_ids, cont_mask, pad_token_id=pad)
            texts = self.processor.batch_decode(full_ids, skip_special_tokens=True)
            scores = self._score(texts, [rollout.rows[i] for i in index])
            for (key, _), score in zip(chunk, scores.tolist()):
                totals[key] += score
        return {k: v / h.mc_samples for k, v in totals.items()}

    def _score(self, texts: list[str], rows: list[Mapping[str, Any]]) -> Tensor:
        from mmpo.rewards import compute_rewards

        total, _per_fn, _metrics = compute_rewards(self.reward_weights, texts, rows, timeout_s=self.rewards.timeout_s)
        return total

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        extras = rollout.extras
        state_values = torch.cat([extras["segment_query_values"].unsqueeze(1), extras["segment_values"]], dim=1)
        advantages, metrics = compute_advantages_with_metrics(
            "segment", rewards, group_ids, mask=rollout.completion_mask.to(rewards),
            old_log_probs=extras["segment_log_probs"].to(rewards), state_values=state_values.to(rewards),
            prob_threshold=SEGMENT_PROB_THRESHOLD, whiten=h.segment_whiten)
        cuts = torch.isfinite(state_values).sum(-1).float()
        metrics["segment/cut_points_mean"] = float(cuts.mean())
        return advantages, metrics
