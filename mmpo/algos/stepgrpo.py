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

from typing import Any

from torch import Tensor

from mmpo.algos.grpo import GRPOModule
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
        num_generations: G (paper 4).
        advantage_eps: group std epsilon (official 1e-4).
        beta: k3 KL coefficient (TRL 0.14 default 0.04, used by R1-VL).
        temperature: sampling temperature (official 2B script 1.2).
        system_prompt: ``"steps"`` = ``mmpo.data.STEPS_SYSTEM_PROMPT``; any other text is used as is.
        reward_weights: None = {StepRAR variant: 1.0, ``step_rvr``: 1.0}.
        **kwargs: every other :class:`GRPOModule` setting.
    """

    def __init__(
        self,
        model_path: str,
        *,
        no_answer_zero: bool = False,
        skip_missing_key_steps: bool = False,
        num_generations: int = 4,
        advantage_eps: float | None = 1e-4,
        beta: float = 0.04,
        temperature: float = 1.2,
        system_prompt: str | None = "steps",
        reward_weights: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if system_prompt == "steps":
            system_prompt = system_prompt_for("steps")
        if reward_weights is None:
            rar = step_rar_reward_name(no_answer_zero=no_answer_zero, skip_missing_key_steps=skip_missing_key_steps)
            reward_weights = {rar: 1.0, "step_rvr": 1.0}
        super().__init__(
            model_path, num_generations=num_generations, advantage_eps=advantage_eps, beta=beta,
            temperature=temperature, system_prompt=system_prompt, reward_weights=reward_weights, **kwargs,
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
