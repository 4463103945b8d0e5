"""Text benchmarks for masked-diffusion LM checkpoints: GSM8K test and MATH-500.

* ``gsm8k_test``: openai/gsm8k, config ``main``, split ``test`` (1,319 items): ``main/test-*.parquet``.
  Columns: question (string), answer (string ending ``#### <number>``).
* ``math500``: HuggingFaceH4/MATH-500, split ``test`` (500 items): ``test.jsonl`` as the publisher
  ships it (or parquet). Columns: problem, solution, answer, subject, level, unique_id.

Both are zero-shot with the instruction to put the final answer in ``\\boxed{}`` (the usual
instruction for MATH-500; LLaDA's reported GSM8K uses lm-eval's 4-shot prompt, so numbers differ).
"""

from __future__ import annotations

from typing import Any, Mapping

from mmpo.eval.benchmarks.base import LocalBenchmark, Row, make_row
from mmpo.eval.benchmarks.files import Layout

GSM8K_LAYOUT = Layout(dir_name="gsm8k", split="test", source="openai/gsm8k (config main)",
                      columns=("question", "answer"))
MATH500_LAYOUT = Layout(dir_name="MATH-500", split="test", source="HuggingFaceH4/MATH-500",
                        columns=("problem", "answer", "subject", "level", "unique_id"))
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_gold(answer: str) -> str:
    """The number after ``####`` in a GSM8K solution, commas removed (``"... #### 1,000"`` -> ``"1000"``)."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def build_gsm8k_row(record: Mapping[str, Any], index: int) -> Row:
    gold = gsm8k_gold(str(record["answer"]))
    return make_row(item_id=f"gsm8k-test-{index}", task="gsm8k", prompt=f"{record['question']}\n{INSTRUCTION}",
                    images=[], answer=gold, scoring={"rule": "number", "gold": gold})


def build_math500_row(record: Mapping[str, Any], index: int) -> Row:
    return make_row(item_id=record["unique_id"], task=str(record["subject"]),
                    prompt=f"{record['problem']}\n{INSTRUCTION}", images=[], answer=record["answer"],
                    scoring={"rule": "math", "gold": str(record["answer"])})


BENCHMARKS = [
    LocalBenchmark(name="gsm8k_test", layout=GSM8K_LAYOUT, build_row=build_gsm8k_row, modality="dllm",
                   description="GSM8K test, zero-shot, numeric match of the final answer"),
    LocalBenchmark(name="math500", layout=MATH500_LAYOUT, build_row=build_math500_row, modality="dllm",
                   description="MATH-500, zero-shot, math-verify equivalence of the \\boxed{} answer"),
]
