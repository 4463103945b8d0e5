"""BRPO: Budget Relative Policy Optimization (AnytimeReasoner, arXiv 2505.13438).

Official code: ``sail-sg/AnytimeReasoner`` (``verl/verl/trainer/ppo/brpo.py``, ``run_experiments.sh``), the
formula and defaults with their sources: ``docs/algorithm_sources.md`` section 12, BRPO. Per step:

1. sample G thinking traces per prompt with the full budget L = ``max_new_tokens``;
2. cut each at the budgets b_j = (L / S) j, j = 1 .. S; at every cut, sample A summaries from
   ``prompt + trace[: b_j] + summary_cue`` (``summary_max_tokens`` each). A trace that ended by itself
   within b_j needs no summary: its own reward is its score at that budget;
3. r_{g,j} = the mean summary score; the trace's reward is the anytime objective sum_j p_j r_{g,j};
4. thinking token t (segment s = t // (L / S)) gets the budget-relative advantage of
   :func:`~mmpo.core.advantages_budget.brpo_segment_advantages` (estimator ``brpo``); summary tokens get
   their score minus the mean of the same trace's summaries at the same budget.

The traces and the summaries are trained together in one rollout (``extras["brpo_kind"]`` 0 / 1). A
summary's prompt holds the truncated trace and the cue, so only the summary tokens are trained there.
Not implemented: the ``grpo`` summary mode (advantage on the last budget only) and the official
summary prompt (UNVERIFIED; here ``summary_cue`` closes the think block and opens the answer).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import refuse_rollout_correction, require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.core import compute_advantages_with_metrics
from mmpo.core.advantages_budget import BUDGET_PRIORS, budget_prior
from mmpo.core.groups import build_group_index
from mmpo.vlm.continuation import ended, extend_prompts, generate_from_inputs
from mmpo.vlm.processing import select_rows
from mmpo.vlm.rollout import Rollout, concat_rollouts


class BRPOModule(GRPOModule):
    """GRPO on anytime reasoning: budgeted thinking traces with summaries and BRPO advantages.

    Args:
        model_path: saved HF model directory.
        num_budgets: S, the number of thinking budgets (official runs 4); must divide ``max_new_tokens``.
        num_summaries: A, summaries sampled per trace and budget (official 4).
        summary_max_tokens: the summary's token budget.
        budget_prior: ``uniform`` (official default), ``linear`` (p_j ∝ b_j) or ``base`` (last budget only).
        summary_cue: text appended after a truncated trace before the summary is sampled.
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is fixed to ``brpo``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        advantage: AdvantageConfig = AdvantageConfig(name="brpo"),
        num_budgets: int = 4,
        num_summaries: int = 4,
        summary_max_tokens: int = 32,
        budget_prior: str = "uniform",
        summary_cue: str = "</think>\n<answer>",
        **kwargs: Any,
    ) -> None:
        advantage = as_config(advantage, AdvantageConfig(name="brpo"))
        require(advantage.name == "brpo", "BRPOModule's advantage is 'brpo'")
        super().__init__(model_path, advantage=advantage, **kwargs)
        self._cue_ids = torch.tensor(self.processor.tokenizer(summary_cue, add_special_tokens=False)["input_ids"],
                                     dtype=torch.long)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(h.num_budgets >= 1, f"num_budgets must be >= 1, got {h.num_budgets}")
        require(self.sampling.max_new_tokens % h.num_budgets == 0,
                f"num_budgets {h.num_budgets} must divide max_new_tokens {self.sampling.max_new_tokens} "
                "(budgets b_j = L j / S)")
        require(h.num_summaries >= 1, f"num_summaries must be >= 1, got {h.num_summaries}")
        require(h.summary_max_tokens >= 1, f"summary_max_tokens must be >= 1, got {h.summary_max_tokens}")
        require(h.budget_prior in BUDGET_PRIORS, f"budget_prior must be one of {BUDGET_PRIORS}, got {h.budget_prior!r}")
        require(not self.advantage.dynamic_sampling_retries,
                "dynamic_sampling_retries is not supported with budgeted rollouts")
        refuse_rollout_correction(self.rollout_correction)

    @property
    def _segment_len(self) -> int:
        return self.sampling.max_new_tokens // self.hparams.num_budgets

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        h = self.hparams
        traces = super().build_rollout(rows)
        traces.extras = {}  # the summaries come from another sampler: only the keys below are shared
        n, width = traces.completion_mask.shape
        lengths = traces.completion_mask.sum(-1)
        done = ended(traces, self.engine.eos_token_id)
        positions = torch.arange(width).expand(n, width)
        traces.extras.update(brpo_kind=torch.zeros(n, dtype=torch.long), brpo_response=torch.arange(n),
                             brpo_budget=torch.full((n,), -1), brpo_segment_ids=positions // self._segment_len)
        # (trace, budget) pairs still thinking at the budget: A summaries each
        pairs = [(g, j) for g in range(n) for j in range(h.num_budgets)
                 if not (bool(done[g]) and int(lengths[g]) <= (j + 1) * self._segment_len)]
        if not pairs:
            return traces
        jobs = [pair for pair in pairs for _ in range(h.num_summaries)]
        index = [g for g, _ in jobs]
        cue = self._cue_ids
        prefix_len = [(j + 1) * self._segment_len for _, j in jobs]
        prefix = torch.full((len(jobs), max(prefix_len) + len(cue)), self.engine.pad_token_id, dtype=torch.long)
        prefix_mask = torch.zeros_like(prefix)
        for k, ((g, _), b) in enumerate(zip(jobs, prefix_len)):
            prefix[k, :b] = traces.completion_ids[g, :b]
            prefix[k, b : b + len(cue)] = cue
            prefix_mask[k, : b + len(cue)] = 1
        prompts = extend_prompts(select_rows(traces.prompt_inputs, index), prefix, prefix_mask,
                                 pad_token_id=self.engine.pad_token_id)
        summaries = generate_from_inputs(self.engine, [traces.rows[g] for g in index], prompts,
                                         max_new_tokens=h.summary_max_tokens,
                                         temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                         group_ids=traces.group_ids[index])
        # the reward reads the whole answer: truncated trace + cue + summary
        heads = self.processor.batch_decode([prefix[k, : prefix_len[k] + len(cue)] for k in range(len(jobs))],
                                            skip_special_tokens=True)
        summaries.texts = [head + text for head, text in zip(heads, summaries.texts)]
        m = len(jobs)
        summaries.extras.update(brpo_kind=torch.ones(m, dtype=torch.long), brpo_response=torch.tensor(index),
                                brpo_budget=torch.tensor([j for _, j in jobs]),
                                brpo_segment_ids=torch.full(summaries.completion_mask.shape, -1))
        combined = concat_rollouts([traces, summaries])
        # concat renumbers the summaries' group ids; they keep their prompt's id (V2 is per prompt)
        combined.group_ids = torch.cat([traces.group_ids, traces.group_ids[index]])
        combined.extras["brpo_segment_ids"][n:] = -1  # the padding concat added is not a segment
        return combined

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """Summary rows: their score; trace rows: the anytime objective sum_j p_j r_{g,j}. Stores the
        (N, S) budget scores of the trace rows in ``extras["brpo_budget_scores"]``."""
        h = self.hparams
        scores, metrics = super().compute_rewards(rollout)
        kind, response, budget = (rollout.extras[k] for k in ("brpo_kind", "brpo_response", "brpo_budget"))
        n = len(rollout)
        sums = torch.zeros(n, h.num_budgets)
        counts = torch.zeros(n, h.num_budgets)
        summary = kind == 1
        sums.index_put_((response[summary], budget[summary]), scores[summary].float(), accumulate=True)
        counts.index_put_((response[summary], budget[summary]), torch.ones(int(summary.sum())), accumulate=True)
        # a budget without summaries: the trace had ended by itself; its own score stands
        budget_scores = torch.where(counts > 0, sums / counts.clamp_min(1), scores.float().unsqueeze(1))
        prior = budget_prior(h.budget_prior, h.num_budgets).float()
        rewards = torch.where(summary, scores.float(), budget_scores @ prior)
        rollout.extras["brpo_budget_scores"] = budget_scores
        metrics["brpo/objective_mean"] = float((budget_scores @ prior)[~summary].mean())
        metrics["brpo/summaries"] = float(summary.sum())
        for j in range(h.num_budgets):
            metrics[f"brpo/score_budget_{j + 1}"] = float(budget_scores[~summary, j].mean())
        return rewards, metrics

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        extras = rollout.extras
        mask = rollout.completion_mask.to(rewards)
        trace = extras["brpo_kind"] == 0
        advantages = torch.zeros_like(mask)
        adv_trace, metrics = compute_advantages_with_metrics(
            "brpo", rewards[trace], group_ids[trace], mask=mask[trace],
            budget_scores=extras["brpo_budget_scores"][trace].to(rewards),
            segment_ids=extras["brpo_segment_ids"][trace], prior=h.budget_prior)
        advantages[trace] = adv_trace
        summary = ~trace
        if bool(summary.any()):
            # summaries of one trace at one budget form a group; score minus its mean (no std)
            key = extras["brpo_response"][summary] * h.num_budgets + extras["brpo_budget"][summary]
            index = build_group_index(key, min_size=1)
            scores = rewards[summary]
            centred = scores - index.mean(scores)[index.inverse]
            advantages[summary] = centred.unsqueeze(1) * mask[summary]
        return advantages, metrics
