"""Imperfect SFT demonstrations: a teacher that abstains on some questions.

The quickstart's demonstration of what RL adds to imitation. The SFT teacher writes a worked
solution for most questions, but on a fixed share of the questions about some colours it
abstains: ``<think>I am not sure.</think><answer>unsure</answer>``, which no reward counts as
correct. SFT copies the teacher, so the SFT model abstains on those questions (greedy decoding
picks the teacher's majority choice). GRPO, rewarded only for correct answers, sees that its
sampled attempts on those questions sometimes score and its abstentions never do, and learns to
attempt them: a change of behaviour on held-out questions that imitating this teacher cannot make.

The rule is deterministic per item (a hash of its id and the seed), so a resumed or repeated run
sees the same demonstrations; validation and test rows are never changed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from mmpo.data.datamodule import PromptDataModule
from mmpo.data.schema import Row
from mmpo.data.synthetic.drawing import COLORS

ABSTAIN_ANSWER = "unsure"
"""The abstaining demonstration's answer (never a correct answer of a synthetic task)."""
ABSTAIN_STEPS = ("I am not sure.",)
"""The abstaining demonstration's reasoning."""

_COLOUR_RE = re.compile(r"\b(" + "|".join(COLORS) + r")\b")


def asked_colour(problem: str) -> str | None:
    """The first colour word of a question (``"What is the value of the red bar?"`` -> ``"red"``), or None."""
    match = _COLOUR_RE.search(problem)
    return match.group(1) if match else None


def _unit_draw(item_id: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by the item id and the seed (stable across processes and runs)."""
    digest = hashlib.sha256(f"abstain:{seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def abstains(row: Row | dict[str, Any], colours: Sequence[str], share: float, seed: int) -> bool:
    """Whether the teacher abstains on this row: its question asks about one of ``colours`` and the
    row's fixed draw falls below ``share``."""
    return asked_colour(str(row["problem"])) in colours and _unit_draw(str(row["id"]), seed) < share


def with_abstentions(rows: Sequence[Row], colours: Sequence[str], share: float, seed: int) -> list[Row]:
    """Copies of ``rows`` where the teacher's abstaining demonstration replaces the solution of the
    rows :func:`abstains` selects (``steps`` and ``answer`` changed, ``abstained`` set True)."""
    check_abstain_settings(colours, share)
    out: list[Row] = []
    for row in rows:
        if abstains(row, colours, share, seed):
            row = {**row, "steps": list(ABSTAIN_STEPS), "answer": ABSTAIN_ANSWER, "abstained": True}
        out.append(row)
    return out


def check_abstain_settings(colours: Sequence[str], share: float) -> None:
    """One-line errors for an unknown colour or a share outside [0, 1]."""
    unknown = [colour for colour in colours if colour not in COLORS]
    if unknown:
        raise ValueError(f"unknown abstain colour(s) {unknown}; valid: {list(COLORS)}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"abstain share must be in [0, 1], got {share}")


def abstention_rate(completions: Sequence[str]) -> float:
    """Share of completions whose answer is the abstention (``<answer>unsure</answer>``)."""
    if not completions:
        return 0.0
    marker = f"<answer>{ABSTAIN_ANSWER}</answer>"
    return sum(marker in text for text in completions) / len(completions)


class AbstainingTeacherDataModule(PromptDataModule):
    """:class:`PromptDataModule` whose synthetic *training* rows come from the abstaining teacher.

    Args:
        abstain_colours: the colours whose questions the teacher may abstain on.
        abstain_share: the share of those questions it abstains on (0: the plain teacher).
        **kwargs: every :class:`PromptDataModule` setting.
    """

    def __init__(self, abstain_colours: Sequence[str] = ("red", "blue", "green"), abstain_share: float = 0.8,
                 **kwargs: Any) -> None:
        check_abstain_settings(abstain_colours, abstain_share)
        super().__init__(**kwargs)
        self.abstain_colours, self.abstain_share = tuple(abstain_colours), abstain_share

    def _synthetic(self, total: int, split: str) -> list[Row]:
        rows = super()._synthetic(total, split)
        if split != "train" or self.abstain_share == 0.0:
            return rows
        return with_abstentions(rows, self.abstain_colours, self.abstain_share, self.seed)
