"""HBPO: Hierarchical Budget Policy Optimization (arXiv 2507.15844) for VLMs.

The G rollouts of a prompt are split evenly into k subgroups, one per token budget ``b`` in
``budgets``; a subgroup's rollouts start their assistant turn with the budget declaration
(``budget_prompt``, official ``"<think> I will answer the question with {b} tokens"``, prefilled, so the
policy continues it). The reward is budget-aware (core :func:`~mmpo.core.hbpo_rewards`: a correct answer
scores ``min(f(n) - alpha |n - b|, f(b))`` with ``f(x) = beta cos(pi x / 2 L_max)``, anything else 0) and
the advantage is hierarchical (core estimator ``hbpo``: subgroup mean minus ``f(b)``, plus the
group-normalised reward). Everything else is the GRPO step (official: clip 0.2 / 0.28, no KL, lr 1e-6).

Official code: ZJU-REAL/HBPO; see docs/variants/hbpo.md for what differs and what is unverified.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.core import compute_advantages_with_metrics
from mmpo.core.advantages_hbpo import BUDGET_REWARD_FORMS, hbpo_rewards
from mmpo.rewards import compute_rewards
from mmpo.vlm.rollout import Rollout, concat_rollouts

BUDGET_KEY = "hbpo_budget"
DEFAULT_BUDGET_PROMPT = "<think> I will answer the question with {budget} tokens"


class HBPOModule(GRPOModule):
    """GRPO with HBPO's budget subgroups, budget-aware reward and hierarchical advantage.

    Args:
        model_path: saved HF model directory.
        budgets: the k token budgets (official 512, 1024, 2048, 2560); ``num_generations`` must be a multiple of k.
        budget_prompt: the assistant-turn prefill of a budget's rollouts, with ``{budget}``.
        max_length: ``L_max`` of the reward (official 4096, the training context); None = ``max_new_tokens``.
        reward_scale: ``beta`` (official 4).
        deviation_weight: ``alpha``; None = ``1 / L_max`` (official).
        reward_form: ``min`` (official code) or ``piecewise`` (paper Eq. 1).
        correctness_reward: the registered reward (or user spec) whose value 1.0 means a correct answer.
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is ``hbpo``; ``reward_weights`` only feed the
            ``rewards/<name>/mean`` metrics, the trained reward is HBPO's).
    """

    def __init__(
        self,
        model_path: str,
        *,
        budgets: list[int] | None = None,
        budget_prompt: str = DEFAULT_BUDGET_PROMPT,
        max_length: int | None = None,
        reward_scale: float = 4.0,
        deviation_weight: float | None = None,
        reward_form: str = "min",
        correctness_reward: str = "accuracy",
        advantage: AdvantageConfig = AdvantageConfig(name="hbpo"),
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, advantage=as_config(advantage, AdvantageConfig(name="hbpo")), **kwargs)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        budgets = self.budgets
        require(self.advantage.name == "hbpo", f"HBPOModule's advantage is 'hbpo', got {self.advantage.name!r}")
        require(len(budgets) >= 1 and all(isinstance(b, int) and b >= 1 for b in budgets),
                f"budgets must be ints >= 1, got {budgets}")
        require(len(set(budgets)) == len(budgets), f"budgets must differ, got {budgets}")
        require(self.sampling.num_generations % len(budgets) == 0,
                f"num_generations {self.sampling.num_generations} must be a multiple of the {len(budgets)} budgets "
                f"{budgets} "
                f"(each budget gets an equal subgroup)")
        require(self.sampling.num_generations // len(budgets) >= 1, "every budget needs at least one rollout")
        require("{budget}" in h.budget_prompt, f"budget_prompt must contain '{{budget}}', got {h.budget_prompt!r}")
        require(h.max_length is None or h.max_length >= 1, f"max_length must be >= 1 or None, got {h.max_length}")
        require(h.reward_form in BUDGET_REWARD_FORMS,
                f"unknown reward_form {h.reward_form!r}; valid: {list(BUDGET_REWARD_FORMS)}")
        require(h.deviation_weight is None or h.deviation_weight >= 0,
                f"deviation_weight must be >= 0 or None, got {h.deviation_weight}")

    @property
    def budgets(self) -> list[int]:
        return list(self.hparams.budgets or [512, 1024, 2048, 2560])

    @property
    def reward_max_length(self) -> int:
        return self.hparams.max_length or self.sampling.max_new_tokens

    def budget_prefix(self, budget: int) -> str:
        return self.hparams.budget_prompt.format(budget=budget)

    # ------------------------------------------------------------------ the step

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G completions per row, G / k per budget, each budget's with its prefilled declaration; grouped
        by row (group id = row), budgets in order inside a group, the budget in ``extras["hbpo_budget"]``."""
        per_budget = self.sampling.num_generations // len(self.budgets)
        parts = []
        for budget in self.budgets:
            prefixed = [{**row, "assistant_prefix": self.budget_prefix(budget)} for row in rows]
            part = self.engine.generate(prefixed, num_samples=per_budget, max_new_tokens=self.sampling.max_new_tokens,
                                        temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                        do_sample=True, **self._engine_log_prob_request())
            part.extras[BUDGET_KEY] = torch.full((len(part),), budget, dtype=torch.long)
            parts.append(part)
        merged = concat_rollouts(parts)
        k, n_rows = len(self.budgets), len(rows)
        # position of (row r, budget j, sample s) in the merged rollout: j * n_rows * m + r * m + s
        order = [j * n_rows * per_budget + r * per_budget + s
                 for r in range(n_rows) for j in range(k) for s in range(per_budget)]
        merged = merged.select(order)
        merged.group_ids = torch.arange(n_rows).repeat_interleave(self.sampling.num_generations)
        return merged

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """HBPO's budget-aware reward from ``correctness_reward`` and the completion lengths; the
        ``reward_weights`` rewards are logged. Rewards see prefix + completion (the official response text)."""
        h = self.hparams
        texts = [(row.get("assistant_prefix") or "") + text for row, text in zip(rollout.rows, rollout.texts)]
        weights = dict(self.reward_weights)
        weights.setdefault(h.correctness_reward, 0.0)  # scored for correctness only
        _, per_fn, metrics = compute_rewards(weights, texts, rollout.rows, timeout_s=self.rewards.timeout_s)
        correct = per_fn[h.correctness_reward] >= 1.0
        lengths = rollout.completion_mask.sum(-1)
        budgets = rollout.extras[BUDGET_KEY]
        rewards = hbpo_rewards(correct, lengths, budgets, max_length=self.reward_max_length, beta=h.reward_scale,
                               alpha=h.deviation_weight, form=h.reward_form)
        metrics["hbpo/correct_frac"] = float(correct.float().mean())
        for budget in self.budgets:
            members = budgets == budget
            metrics[f"hbpo/length_mean/b{budget}"] = float(lengths[members].float().mean())
            metrics[f"hbpo/reward_mean/b{budget}"] = float(rewards[members].mean())
        return rewards, metrics

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        return compute_advantages_with_metrics(
            "hbpo", rewards, group_ids, budgets=rollout.extras[BUDGET_KEY].to(rewards.device),
            max_length=self.reward_max_length, beta=h.reward_scale,
            eps=self.advantage.eps if self.advantage.eps is not None else 1e-6)
