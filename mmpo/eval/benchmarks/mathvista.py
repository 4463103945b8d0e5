"""MathVista testmini (AI4Math/MathVista, split ``testmini``, 1,000 items).

Columns (dataset card): pid (string), question (string), image (string: ``images/<pid>.jpg``),
decoded_image (Image), choices (list of string, None for free-form), unit (string or None),
precision (float or None), answer (string), question_type (``multi_choice`` / ``free_form``),
answer_type (``integer`` / ``float`` / ``text`` / ``list``), metadata (struct), query (string:
the publisher's prompt with the hint, question and choices).
"""

from __future__ import annotations

from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row
from mmpo.eval.benchmarks.files import Layout

LAYOUT = Layout(
    dir_name="MathVista", split="testmini", source="AI4Math/MathVista",
    columns=("pid", "question", "image", "decoded_image", "choices", "unit", "precision", "answer",
             "question_type", "answer_type", "query"),
)


def build_row(record: Mapping[str, Any], index: int = 0) -> Row:
    choices = list(record.get("choices") or [])
    scoring: dict[str, Any] = {
        "rule": "mathvista", "question_type": record["question_type"], "answer_type": record["answer_type"],
        "precision": record.get("precision"), "unit": record.get("unit"), "choices": choices,
        "gold": str(record["answer"]),
    }
    if record["question_type"] == "multi_choice":
        if str(record["answer"]) not in choices:
            raise ValueError(f"MathVista item {record['pid']!r}: answer {record['answer']!r} is not one of {choices}")
        scoring["gold"] = chr(ord("A") + choices.index(str(record["answer"])))
    metadata = record.get("metadata") or {}
    # decoded_image is embedded; image is the path inside the publisher's images.zip (a fallback).
    image = record.get("decoded_image") or record.get("image")
    return make_row(item_id=record["pid"], task=str(metadata.get("task") or record["question_type"]),
                    prompt=str(record["query"]), images=[image], answer=record["answer"], scoring=scoring)


BENCHMARK = LocalBenchmark(
    name="mathvista_testmini", layout=LAYOUT, build_row=build_row,
    description="MathVista testmini: the publisher's `query` prompt; rule-based extraction (official: GPT-4)",
)
