"""Geometry benchmarks: Geometry3K test (hiyouga/geometry3k) and GeoQA (R1-V layout).

* ``geometry3k_test``: hiyouga/geometry3k, split ``test`` (601 items). Columns (dataset card):
  images (list of Image), problem (string starting with ``<image>``), answer (string, may be LaTeX).
  Prompt: the problem + EasyR1's math format instruction (examples/format_prompt/math.jinja).
* ``geoqa``: the R1-V GeoQA layout (leonardPKU/GEOQA_R1V_Train_8K's columns: image (Image),
  problem (string), solution (string ``<answer>X</answer>``)), split ``test``: put the GeoQA test
  set in those columns as ``test-*.parquet``. Prompt: R1-V's QUESTION_TEMPLATE
  (src/eval/test_qwen2vl_geoqa.py); scoring: math-verify, as R1-V's evaluation.
"""

from __future__ import annotations

from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row
from mmpo.eval.benchmarks.files import Layout
from mmpo.rewards.answers import extract_answer

GEOMETRY3K_LAYOUT = Layout(dir_name="geometry3k", split="test", source="hiyouga/geometry3k",
                           columns=("images", "problem", "answer"))
GEOQA_LAYOUT = Layout(dir_name="GeoQA", split="test", source="GeoQA test in the R1-V layout "
                      "(leonardPKU/GEOQA_R1V_Train_8K columns)", columns=("image", "problem", "solution"))
EASYR1_MATH_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
R1V_GEOQA_TEMPLATE = ("{question} Output the thinking process in <think> </think> and final answer (number) "
                      "in <answer> </answer> tags.")


def build_geometry3k_row(record: Mapping[str, Any], index: int) -> Row:
    problem = str(record["problem"]).replace("<image>", "").strip()
    return make_row(item_id=f"geometry3k-test-{index}", task="geometry3k",
                    prompt=f"{problem} {EASYR1_MATH_INSTRUCTION}", images=list(record["images"] or []),
                    answer=record["answer"], scoring={"rule": "math", "gold": str(record["answer"])})


def build_geoqa_row(record: Mapping[str, Any], index: int) -> Row:
    solution = str(record["solution"])
    gold = extract_answer(solution) or solution.strip()
    problem = str(record["problem"]).replace("<image>", "").strip()
    return make_row(item_id=f"geoqa-test-{index}", task="geoqa", prompt=R1V_GEOQA_TEMPLATE.format(question=problem),
                    images=[record["image"]], answer=gold, scoring={"rule": "math", "gold": gold})


BENCHMARKS = [
    LocalBenchmark(name="geometry3k_test", layout=GEOMETRY3K_LAYOUT, build_row=build_geometry3k_row,
                   description="Geometry3K test (601 items), EasyR1 math prompt, math-verify equivalence"),
    LocalBenchmark(name="geoqa", layout=GEOQA_LAYOUT, build_row=build_geoqa_row,
                   description="GeoQA test, R1-V prompt and math-verify scoring (as R1-V's evaluation)"),
]
