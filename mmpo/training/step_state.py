"""The typed record of one training step, passed to every hook of the step.

A module's ``training_step`` creates one :class:`StepState`, hands it to ``begin_step`` (before the rollout),
fills in the rollout, rewards and advantages as it computes them, hands it to the loss hooks (as
``outputs["step"]``) and to ``end_step`` (after the update), then logs ``state.metrics``. What one hook
leaves for a later hook of the same step goes through this object (``collect`` / ``collected``), never
through a module attribute set in one hook and read in another; what outlives the step is algorithm
state, checkpointed by :class:`~mmpo.training.state_hooks.CheckpointedState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class StepState:
    """One training step.

    Attributes:
        step: the trainer's ``global_step`` when the step began (optimizer steps taken so far).
        rows: the prompts of the step; ``begin_step`` may replace them (SPO's prioritised draw).
        rollout: the rollout as sampled (after a resample of constant groups, before group filters).
        rewards: ``(N,)`` total rewards of ``rollout``.
        advantages: the advantages the update trains on.
        update_stats: each optimizer step's metrics from the update engine.
        metrics: metrics the hooks add; logged with the step's own at its end.
    """

    step: int
    rows: list[Mapping[str, Any]]
    rollout: Any = None
    rewards: Any = None
    advantages: Any = None
    update_stats: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    _collected: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    def collect(self, name: str, value: Any) -> None:
        """Keep ``value`` under ``name`` for a later hook of this step (e.g. per-micro-batch entropies)."""
        self._collected.setdefault(name, []).append(value)

    def collected(self, name: str) -> list[Any]:
        """Everything collected under ``name`` this step, in order (empty when nothing was)."""
        return list(self._collected.get(name, []))
