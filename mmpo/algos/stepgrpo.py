"""StepGRPO: step-wise group relative policy optimization (R1-VL, arXiv 2503.12937).

GRPO with dense step-wise rewards on responses in the R1-VL section format:

1. SFT warm-up in the "steps" style (``mmpo.data.render_solution(row, "steps")``,
   ``SFTModule(style="steps")``); RL prompts use the matching system prompt.
2. Roll out G = 4 completions per prompt (temperature 1.2 in the official 2B script).
3. Rewards (``mmpo.rewards.step``): StepRAR = 1[correct] + 0.1 x (fraction of key-step groups
   matched in the Step sections) plus StepRVR = 1 for a complete, ordered step structure;
   summed with weights 1 and 1. Rows without key steps raise (naming the row) or, with
   ``skip_missing_key_steps``, score k = 0 and are counted.
4. Group advantages (r - mean) / (std + 1e-4), then the policy loss with beta 0.04 (k3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, LossConfig, RewardConfig, SamplingConfig, as_config
from mmpo.data import system_prompt_for
from mmpo.rewards.step import key_step_match_fraction, step_rar_reward_name
from mmpo.vlm.rollout import Rollout


class StepGRPOModule(GRPOModule):
    """StepGRPO (arXiv 2503.12937) on top of :class:`~mmpo.algos.grpo.GRPOModule`.

    Args:
        model_path: saved HF model directory (SFT-warmed in the "steps" style).
        no_answer_zero: the paper's "no final answer -> StepRAR 0" rule (the official code lacks it).
        skip_missing_key_steps: rows without ``key_steps`` score k = 0 and are counted
            (``stepgrpo/missing_key_steps``) instead of raising.
        sampling: G 4 (paper) and temperature 1.2 (official 2B script) by default.
        advantage: group std epsilon ``eps`` 1e-4 by default (official).
        loss: k3 KL coefficient ``beta`` 0.04 by default (TRL 0.14 default, used by R1-VL).
        system_prompt: ``"steps"`` = ``mmpo.data.STEPS_SYSTEM_PROMPT``; any other text is used as is.
        rewards: ``weights`` None = {StepRAR variant: 1.0, ``step_rvr``: 1.0}.
        **kwargs: every other :class:`GRPOModule` setting.
    """

    def __init__(
        self,
        model_path: str,
        *,
        no_answer_zero: bool = False,
        skip_missing_key_steps: bool = False,
        sampling: SamplingConfig = SamplingConfig(temperature=1.2),
        advantage: AdvantageConfig = AdvantageConfig(eps=1e-4),
        loss: LossConfig = LossConfig(beta=0.04),
        system_prompt: str | None = "steps",
        rewards: RewardConfig = RewardConfig(),
        **kwargs: Any,
    ) -> None:
        if system_prompt == "steps":
            system_prompt = system_prompt_for("steps")
        rewards = as_config(rewards, RewardConfig())
        if rewards.weights is None:
            rar = step_rar_reward_name(no_answer_zero=no_answer_zero, skip_missing_key_steps=skip_missing_key_steps)
            rewards = dataclasses.replace(rewards, weights={rar: 1.0, "step_rvr": 1.0})
        super().__init__(
            model_path, sampling=as_config(sampling, SamplingConfig(temperature=1.2)),
            advantage=as_config(advantage, AdvantageConfig(eps=1e-4)), loss=as_config(loss, LossConfig(beta=0.04)),
            system_prompt=system_prompt, rewards=rewards, **kwargs,
        )

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        # Check the rows first: a raising reward function is only logged as zeros by
        # compute_rewards, but a dataset without key steps is a configuration error.
        missing = [str(row.get("id")) for row in rollout.rows if not row.get("key_steps")]
        if missing and not self.hparams.skip_missing_key_steps:
            raise ValueError(
                f"StepGRPO: rows without key_steps: {sorted(set(missing))[:5]} (StepRAR needs them; "
                "set skip_missing_key_steps: true to score k = 0 and count them)"
            )
        total, metrics = super().compute_rewards(rollout)
        fractions = [key_step_match_fraction(text, row.get("key_steps") or [])
                     for text, row in zip(rollout.texts, rollout.rows)]
        metrics["stepgrpo/key_step_frac"] = sum(fractions) / len(fractions)
        metrics["stepgrpo/missing_key_steps"] = float(len(missing))
        return total, metrics
