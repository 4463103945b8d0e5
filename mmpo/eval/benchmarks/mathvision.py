"""MathVision (MathLLMs/MathVision, split ``test``: 3,040 items; ``testmini``: 304).

Columns (dataset card): id (string), question (string, with ``<image1>`` placeholders), options
(list of string; empty for free-form), image (string: ``images/<id>.jpg``), decoded_image (Image),
answer (string: a letter when there are options), solution (string), level (int64), subject (string).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row, options_block
from mmpo.eval.benchmarks.files import Layout

LAYOUT = Layout(
    dir_name="MathVision", split="test", source="MathLLMs/MathVision",
    columns=("id", "question", "options", "image", "decoded_image", "answer", "level", "subject"),
)
# The publisher's evaluation instruction (MathVision README, "put your final answer in \boxed{}").
INSTRUCTION = ("Please solve the problem step by step and put your final answer in \\boxed{}. "
               "If it is a multiple choice question, only one letter is allowed in the \\boxed{}.")
_PLACEHOLDER_RE = re.compile(r"<image\d*>")


def build_row(record: Mapping[str, Any], index: int = 0) -> Row:
    question = _PLACEHOLDER_RE.sub("", str(record["question"])).strip()
    options = [str(option) for option in (record.get("options") or [])]
    if options:
        prompt = f"{question}\n\nChoices:\n{options_block(options)}\n\n{INSTRUCTION}"
        scoring = {"rule": "choice", "choices": options, "gold": str(record["answer"])}
    else:
        prompt = f"{question}\n\n{INSTRUCTION}"
        scoring = {"rule": "math", "gold": str(record["answer"])}
    image = record.get("decoded_image") or record.get("image")
    return make_row(item_id=record["id"], task=str(record["subject"]), prompt=prompt, images=[image],
                    answer=record["answer"], scoring=scoring)


BENCHMARK = LocalBenchmark(
    name="mathvision", layout=LAYOUT, build_row=build_row,
    description="MathVision test (3,040 items); rule-based extraction, math-verify equivalence",
)
