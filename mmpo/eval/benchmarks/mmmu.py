"""MMMU validation, multiple-choice questions (MMMU/MMMU, 30 subject configs, split ``validation``).

Files: the publisher's per-subject parquet files, ``MMMU/<Subject>/validation-*.parquet``. Columns
(dataset card): id (``validation_<Subject>_<n>``), question (with ``<image k>`` placeholders),
options (string: a Python list literal), explanation, image_1 .. image_7 (Image or None), img_type,
answer (a letter), topic_difficulty, question_type (``multiple-choice`` / ``open``), subfield.
Open questions are left out (``mmmu_val`` is the multiple-choice subset, 847 of 900 items).
Prompt: MMMU's ``multi_choice_example_format`` (question, ``(A) ...`` options, "Answer with the
option's letter from the given choices directly.").
"""

from __future__ import annotations

import ast
from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row, options_block
from mmpo.eval.benchmarks.files import Layout

LAYOUT = Layout(dir_name="MMMU", split="validation", source="MMMU/MMMU (all subject configs)",
                columns=("id", "question", "options", "answer", "question_type", "image_1"))
INSTRUCTION = "Answer with the option's letter from the given choices directly."
MAX_IMAGES = 7


def subject_of(item_id: str) -> str:
    """``validation_Art_Theory_12`` -> ``Art_Theory``."""
    parts = item_id.split("_")
    return "_".join(parts[1:-1]) or item_id


def build_row(record: Mapping[str, Any], index: int) -> Row | None:
    if record["question_type"] != "multiple-choice":
        return None
    options = [str(option) for option in ast.literal_eval(str(record["options"]))]
    prompt = f"{record['question']}\n\n{options_block(options)}\n\n{INSTRUCTION}"
    images = [record.get(f"image_{number}") for number in range(1, MAX_IMAGES + 1)]
    return make_row(item_id=record["id"], task=subject_of(str(record["id"])), prompt=prompt, images=images,
                    answer=record["answer"], scoring={"rule": "choice", "choices": options, "gold": str(record["answer"])})


BENCHMARK = LocalBenchmark(name="mmmu_val", layout=LAYOUT, build_row=build_row,
                           description="MMMU validation, multiple-choice items; no answer scores 0 "
                                       "(the official parser guesses at random)")
