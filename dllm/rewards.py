"""Answer extraction and the correctness reward for text completions.

IGPO's trigger (arXiv 2509.10396; official code) looks only at the correctness reward.
Our completions end with ``A:<number>`` (see ``dllm.task``); real-checkpoint prompts may
answer in ``\\boxed{...}``. Integers are compared exactly; anything else falls back to
math-verify (the project's answer checker) so ``1/2`` and ``0.5`` agree.
"""

from __future__ import annotations

import re

from dllm.task import ANSWER_PREFIX

_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"\s*(-?\d+)")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_INT_RE = re.compile(r"-?\d+")


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: the last ``A:<int>`` or ``\\boxed{...}``; ``None`` if absent."""
    matches = _ANSWER_RE.findall(text)
    if matches:
        return matches[-1]
    boxed = _BOXED_RE.findall(text)
    if boxed:
        return boxed[-1].strip()
    return None


def is_correct(completion: str, answer: str) -> bool:
    """Whether ``completion``'s extracted answer equals the reference ``answer``."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    gold = str(answer).strip()
    if _INT_RE.fullmatch(predicted) and _INT_RE.fullmatch(gold):
        return int(predicted) == int(gold)
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${predicted}$")))
    except Exception:  # math-verify raises on unparsable input: that is a wrong answer, not a dead run.
        return False


def correctness_rewards(completions: list[str], answers: list[str], *, correct: float = 1.0) -> list[float]:
    """``correct`` for each right answer, 0.0 otherwise (IGPO's trigger reward; it uses 3.0)."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    return [correct if is_correct(c, a) else 0.0 for c, a in zip(completions, answers)]
