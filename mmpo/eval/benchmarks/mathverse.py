"""MathVerse testmini (AI4Math/MathVerse, config ``testmini``: 788 problems x 5 versions = 3,940 items).

Columns (dataset card): sample_index, problem_index, problem_version (``Text Dominant``,
``Text Lite``, ``Vision Intensive``, ``Vision Dominant``, ``Vision Only``), question, image (Image),
answer (a letter for ``multi-choice``, else the value), question_type (``multi-choice`` /
``free-form``), metadata (struct), query_wo (prompt without chain of thought), query_cot (with),
question_for_eval. ``mathverse_testmini`` keeps every version (reported per version);
``mathverse_testmini/<version>`` (e.g. ``mathverse_testmini/vision_only``) keeps one.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row
from mmpo.eval.benchmarks.files import Layout

LAYOUT = Layout(
    dir_name="MathVerse", split="testmini", source="AI4Math/MathVerse (config testmini)",
    columns=("sample_index", "problem_index", "problem_version", "question", "image", "answer",
             "question_type", "query_wo", "query_cot"),
)
VERSIONS = ("Text Dominant", "Text Lite", "Vision Intensive", "Vision Dominant", "Vision Only")
PROMPT_COLUMN = "query_cot"
"""The publisher's chain-of-thought prompt (the paper's main setting); ``query_wo`` asks for the answer only."""

_CHOICE_LINE_RE = re.compile(r"^\s*\(?([A-H])\)?\s*[:.)]\s*(.+?)\s*$")


def version_slug(version: str) -> str:
    return version.lower().replace(" ", "_")


def parse_choices(question: str) -> list[str]:
    """Option texts listed after ``Choices:`` in the question (empty when they are only in the image)."""
    if "Choices:" not in question:
        return []
    options = []
    for line in question.rsplit("Choices:", 1)[1].splitlines():
        match = _CHOICE_LINE_RE.match(line)
        if match and match.group(1) == chr(ord("A") + len(options)):
            options.append(match.group(2))
    return options


def build_row(record: Mapping[str, Any], index: int = 0) -> Row:
    if record["question_type"] == "multi-choice":
        scoring = {"rule": "choice", "choices": parse_choices(str(record["question"])), "gold": str(record["answer"])}
    else:
        scoring = {"rule": "math", "gold": str(record["answer"])}
    row = make_row(item_id=record["sample_index"], task=str(record["problem_version"]),
                   prompt=str(record[PROMPT_COLUMN]), images=[record["image"]], answer=record["answer"],
                   scoring=scoring)
    row["question"] = str(record["question"])  # the official second-stage scoring prompt's [Question]
    return row


def _only(version: str):
    def build(record: Mapping[str, Any], index: int) -> Row | None:
        return build_row(record, index) if record["problem_version"] == version else None

    return build


BENCHMARKS = [
    LocalBenchmark(name="mathverse_testmini", layout=LAYOUT, build_row=build_row,
                   description="MathVerse testmini, all 5 problem versions (`query_cot` prompt); rule-based "
                               "extraction and scoring (official: GPT-4 extraction and judging)"),
    *[LocalBenchmark(name=f"mathverse_testmini/{version_slug(version)}", layout=LAYOUT, build_row=_only(version),
                     description=f"MathVerse testmini, version '{version}' only") for version in VERSIONS],
]
