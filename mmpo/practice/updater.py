"""One Training-Free GRPO library update from a batch of rollout groups (the official ``ExperienceUpdater.run``).

Stages (TencentCloudADP/youtu-agent ``utu/practice/experience_updater.py``):

1. ``_single_rollout_summary``: every attempt of every group kept by the filter is summarised;
2. ``_group_advantage``: per group, the extractor compares the summarised attempts (with their rewards) and
   writes at most ``num_experiences`` experiences in ``<Experiences>`` tags (the "semantic advantage");
3. ``_group_update``: per group, the extractor proposes operations against the library as it was before the
   batch (groups are independent, as in the official concurrent calls);
4. ``_batch_update``: all proposals go to the extractor once more, which answers the net operations (retried
   up to ``retries`` times on unreadable answers; none readable leaves the library unchanged); they are
   applied and the library renumbered (:func:`mmpo.practice.experience.apply_operations`).

With ``given_ground_truth`` only groups with 0 < mean reward < 1 take part and the prompts show the answer and
rewards; without it every group takes part and both are ``[REDACTED]``. Unreadable group-update answers drop
that group's proposals (the official loop logs and skips them); they are counted in the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from mmpo.practice.backends import GenerativeBackend, render
from mmpo.practice.experience import (
    OperationFormatError,
    apply_operations,
    extract_experiences,
    format_experiences,
    format_operations_for_batch,
    parse_operations,
    partially_correct,
)


@dataclass
class Group:
    """One problem's rollouts: the row (``problem``, ``answer``, ...), the completions and their rewards."""

    row: Mapping[str, Any]
    completions: list[str]
    rewards: list[float]


@dataclass
class UpdateStats:
    groups: int = 0
    groups_used: int = 0
    groups_with_experiences: int = 0
    group_update_failures: int = 0
    proposed_operations: int = 0
    batch_update_failures: int = 0
    applied_operations: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"groups": self.groups, "groups_used": self.groups_used,
                "groups_with_experiences": self.groups_with_experiences,
                "group_update_failures": self.group_update_failures,
                "proposed_operations": self.proposed_operations,
                "batch_update_failures": self.batch_update_failures, "applied_operations": dict(self.applied_operations)}


class ExperienceUpdater:
    def __init__(self, backend: GenerativeBackend, *, agent_objective: str, learning_objective: str,
                 num_experiences: int = 2, given_ground_truth: bool = True, retries: int = 3) -> None:
        self.backend = backend
        self.objectives = dict(agent_objective=agent_objective, learning_objective=learning_objective)
        self.num_experiences, self.given_ground_truth, self.retries = num_experiences, given_ground_truth, retries

    def _ask(self, stage: str, context: Mapping[str, Any], **fields: Any) -> str:
        system, user = render(stage, num_experiences=self.num_experiences, **self.objectives, **fields)
        return self.backend.complete(system, user, stage=stage, context=context)

    def selected(self, groups: Sequence[Group]) -> list[Group]:
        """The groups that take part: the partially correct ones with ground truth, else all of them."""
        return [g for g in groups if partially_correct(g.rewards)] if self.given_ground_truth else list(groups)

    def run(self, groups: Sequence[Group], experiences: Mapping[str, str]) -> tuple[dict[str, str], UpdateStats]:
        """The library after learning from ``groups`` (``experiences`` is not changed), and the update's counts."""
        stats = UpdateStats(groups=len(groups))
        kept = self.selected(groups)
        stats.groups_used = len(kept)
        truth = self.given_ground_truth
        proposals: list[dict[str, Any]] = []
        for group in kept:
            answer = str(group.row["answer"]) if truth else "[REDACTED]"
            summaries = [self._ask("summary", {"row": group.row, "trajectory": text, "reward": reward},
                                   question=group.row["problem"], answer=answer, trajectory=text)
                         for text, reward in zip(group.completions, group.rewards)]
            trajectories = "\n\n".join(f"Attempt {i + 1} (Reward {reward if truth else '[REDACTED]'}):\n{summary}"
                                       for i, (summary, reward) in enumerate(zip(summaries, group.rewards)))
            critique = self._ask("group_advantage", {"row": group.row, "summaries": summaries,
                                                     "rewards": group.rewards},
                                 question=group.row["problem"], answer=answer, trajectories=trajectories)
            new = extract_experiences(critique)
            if not new:  # the official loop still asks for operations on "" ; nothing can come of it, so skip
                continue
            stats.groups_with_experiences += 1
            reply = self._ask("group_update", {"experiences": dict(experiences), "new_experiences": new},
                              existing=format_experiences(experiences), new=new)
            try:
                proposals.extend(parse_operations(reply))
            except OperationFormatError:
                stats.group_update_failures += 1
        stats.proposed_operations = len(proposals)
        if not proposals:
            return dict(experiences), stats  # official: "No batch operations." -> an empty plan, ids renumbered
        plan: list[dict[str, Any]] = []
        for _ in range(self.retries):
            reply = self._ask("batch_update", {"experiences": dict(experiences), "operations": proposals},
                              listing=format_operations_for_batch(experiences, proposals))
            try:
                plan = parse_operations(reply)
                break
            except OperationFormatError:
                stats.batch_update_failures += 1
        for op in plan:
            if op.get("content"):
                name = op.get("operation", "ADD")
                stats.applied_operations[name] = stats.applied_operations.get(name, 0) + 1
        return apply_operations(experiences, plan), stats
