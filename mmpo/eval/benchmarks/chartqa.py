"""ChartQA test (HuggingFaceM4/ChartQA, split ``test``: 2,500 items).

Columns (dataset card): image (Image), query (string), label (list of string, one answer),
human_or_machine (ClassLabel: 0 human, 1 machine). Scored by relaxed accuracy (pix2struct's
``relaxed_correctness``); the report's ``by_task`` splits human / augmented questions as the paper does.
"""

from __future__ import annotations

from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row
from mmpo.eval.benchmarks.files import Layout

LAYOUT = Layout(dir_name="ChartQA", split="test", source="HuggingFaceM4/ChartQA",
                columns=("image", "query", "label"))
# A single word or phrase, as in the instruction used for Qwen-VL's ChartQA evaluation.
INSTRUCTION = "Answer the question using a single word or phrase."
SPLIT_NAMES = {0: "human", 1: "augmented"}


def build_row(record: Mapping[str, Any], index: int) -> Row:
    label = record["label"]
    gold = str(label[0] if isinstance(label, (list, tuple)) else label)
    task = SPLIT_NAMES.get(record.get("human_or_machine"), "chartqa")
    return make_row(item_id=f"chartqa-test-{index}", task=task, prompt=f"{record['query']}\n{INSTRUCTION}",
                    images=[record["image"]], answer=gold, scoring={"rule": "relaxed", "gold": gold})


BENCHMARK = LocalBenchmark(name="chartqa_test", layout=LAYOUT, build_row=build_row,
                           description="ChartQA test, relaxed accuracy (5% tolerance for numbers, else exact)")
