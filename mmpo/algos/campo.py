"""CAMPO: Context-Aware Multi-Stage Policy Optimization (MiroMind-M1, arXiv 2507.14683) for VLMs.

GRPO (DAPO-style settings: clip 0.2 / 0.28, token-mean, dynamic sampling, no KL) plus

1. a multi-stage context-length schedule: stage ``k`` samples up to ``stage_lengths[k]`` new tokens and
   starts at optimizer step ``stage_starts[k - 1]`` (the official runs: 16k then 32k for the 7B model,
   as two separate launches; here one run moves through the stages). The current stage and the step it
   began are saved in Lightning checkpoints (``campo_stage``) and restored on resume;
2. the repetition critic (:mod:`mmpo.core.repetition`): a response that used its whole length budget and
   ends in a loop loses ``repetition_penalty`` (official 0.1) before the group statistics.

Official code: MiroMindAsia/MiroMind-M1 ``rl_train/`` and ``verl/trainer/ppo/core_algos.py``
(``compute_campo_outcome_advantage``); see docs/variants/campo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Mapping, Sequence

from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.core.repetition import REPETITION_MODES, repetition_penalties
from mmpo.vlm.rollout import Rollout


def stage_at(step: int, stage_starts: Sequence[int]) -> int:
    """Index of the stage that optimizer step ``step`` is in (``stage_starts`` ascending: where stages 1.. begin)."""
    return sum(1 for start in stage_starts if step >= start)


@dataclass
class StageProgress:
    """The current stage of the length schedule and the step it began (checkpointed as ``campo_stage``)."""

    lengths: list[int]
    stage: int = 0
    started_at: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "started_at": self.started_at, "lengths": list(self.lengths)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["lengths"]) != list(self.lengths):
            raise ValueError(f"the checkpoint was trained with stage_lengths {state['lengths']}, this run has "
                             f"{self.lengths}: resume with the same schedule")
        self.stage, self.started_at = int(state["stage"]), int(state["started_at"])


class CAMPOModule(CheckpointedState, GRPOModule):
    """GRPO with CAMPO's staged length budget and repetition penalty.

    Args:
        model_path: saved HF model directory.
        stage_lengths: max new tokens of each stage, e.g. ``[32, 64]``; None = one stage of
            ``max_new_tokens``. Official 7B: 16384 then 32768.
        stage_starts: the optimizer step at which each stage after the first begins (ascending, one
            fewer than ``stage_lengths``).
        repetition_penalty: subtracted from the reward of a looping response (official 0.1); 0 = off.
        repetition_mode: ``constant`` (official code) or ``ratio`` (penalty x the loop's share of the response).
        repetition_min_repeats: copies that make a loop (official 2).
        penalize_only_truncated: only responses that used the whole stage budget are checked (official).
        **kwargs: every :class:`GRPOModule` setting (``max_new_tokens`` is the first stage's length when
            ``stage_lengths`` is given).
    """

    checkpointed_state = (("campo_stage", "progress"),)

    def __init__(
        self,
        model_path: str,
        *,
        stage_lengths: list[int] | None = None,
        stage_starts: list[int] | None = None,
        repetition_penalty: float = 0.1,
        repetition_mode: str = "constant",
        repetition_min_repeats: int = 2,
        penalize_only_truncated: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, **kwargs)
        self.progress = StageProgress(lengths=self.stage_lengths)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        lengths, starts = self.stage_lengths, list(h.stage_starts or [])
        require(all(isinstance(n, int) and n >= 1 for n in lengths), f"stage_lengths must be ints >= 1, got {lengths}")
        require(len(starts) == len(lengths) - 1,
                f"stage_starts needs one step per stage after the first: {len(lengths)} stages, got {starts}")
        require(all(b > a for a, b in zip([0, *starts], starts)),
                f"stage_starts must be ascending steps > 0, got {starts}")
        require(h.repetition_penalty >= 0, f"repetition_penalty must be >= 0, got {h.repetition_penalty}")
        require(h.repetition_mode in REPETITION_MODES,
                f"unknown repetition_mode {h.repetition_mode!r}; valid: {list(REPETITION_MODES)}")
        require(h.repetition_min_repeats >= 2, f"repetition_min_repeats must be >= 2, got {h.repetition_min_repeats}")

    @property
    def stage_lengths(self) -> list[int]:
        h = self.hparams
        return list(h.stage_lengths) if h.stage_lengths else [self.sampling.max_new_tokens]

    @property
    def stage_max_new_tokens(self) -> int:
        """The length budget of the current stage."""
        return self.stage_lengths[self.progress.stage]

    # ------------------------------------------------------------------ the step

    def begin_step(self, state: StepState) -> None:
        stage = stage_at(state.step, self.hparams.stage_starts or [])
        if stage != self.progress.stage:
            self.progress.stage, self.progress.started_at = stage, state.step

    def end_step(self, state: StepState) -> None:
        state.metrics.update({"campo/stage": float(self.progress.stage), "campo/max_new_tokens": float(self.stage_max_new_tokens)})

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G completions per row within the current stage's length budget."""
        return self.engine.generate(
            rows, num_samples=self.sampling.num_generations, max_new_tokens=self.stage_max_new_tokens,
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, do_sample=True,
            **self._engine_log_prob_request(),
        )

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The weighted rewards minus the repetition penalty of looping, budget-exhausting responses."""
        total, metrics = super().compute_rewards(rollout)
        h = self.hparams
        if h.repetition_penalty == 0:
            return total, metrics
        penalties, ratios = repetition_penalties(
            rollout.completion_ids.cpu(), rollout.completion_mask.cpu(), max_length=self.stage_max_new_tokens,
            penalty=h.repetition_penalty, mode=h.repetition_mode, min_repeats=h.repetition_min_repeats,
            only_truncated=h.penalize_only_truncated)
        metrics["campo/repetition_frac"] = float((penalties > 0).float().mean())
        metrics["campo/loop_ratio_mean"] = float(ratios.mean())
        metrics["campo/repetition_penalty_mean"] = float(penalties.mean())
        return total - penalties.to(total), metrics
