"""Answer extraction, the correctness reward and format rewards for text completions.

IGPO's trigger (arXiv 2509.10396; official code) looks only at the correctness reward.
Our completions end with ``A:<number>`` (see ``dllm.task``); real-checkpoint prompts may
answer in ``\\boxed{...}``. Integers are compared exactly; anything else falls back to
math-verify (the project's answer checker) so ``1/2`` and ``0.5`` agree.

Format rewards are added to the correctness reward (IGPO's official run: xmlcount + 3.0 x
correct) but never trigger hinting: the all-wrong test looks at correctness alone.
"""

from __future__ import annotations

import re

from dllm.task import ANSWER_PREFIX

_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"\s*(-?\d+)")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_INT_RE = re.compile(r"-?\d+")
_STEP_RE = re.compile(r"-?\d+[+\-*]-?\d+=-?\d+")


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


def xmlcount_format_reward(text: str) -> float:
    """IGPO's ``count_xml`` (``facebookresearch/igpo:utils/reward_func.py``), at most 0.75.

    0.125 for each of ``<reasoning>\\n``, ``</reasoning>``, ``<answer>\\n``, ``</answer>`` occurring
    exactly once, plus 0.25 when a ``\\boxed{`` appears. (d1's older version also subtracts 0.001
    per character after ``</answer>``; IGPO dropped that.)
    """
    score = 0.0
    for tag in ("<reasoning>\n", "</reasoning>", "<answer>\n", "</answer>"):
        if text.count(tag) == 1:
            score += 0.125
    if "\\boxed{" in text:
        score += 0.25
    return score


def derivation_format_reward(text: str) -> float:
    """Format of the synthetic arithmetic derivation (``dllm.task``), at most 0.75.

    The xmlcount idea for our trace layout (one ``a<op>b=c`` step per line, then ``A:<int>``):
    0.25 if exactly one answer line ``A:<int>`` exists, 0.25 if it is the last non-empty line,
    and 0.25 x the fraction of the other non-empty lines that are well-formed steps (0 when
    there are none). Whether the steps are *right* is the correctness reward's business.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    answer_lines = [i for i, line in enumerate(lines) if _ANSWER_RE.fullmatch(line)]
    score = 0.0
    if len(answer_lines) == 1:
        score += 0.25
        if answer_lines[0] == len(lines) - 1:
            score += 0.25
    steps = [line for i, line in enumerate(lines) if i not in answer_lines]
    if steps:
        score += 0.25 * sum(bool(_STEP_RE.fullmatch(line)) for line in steps) / len(steps)
    return score


FORMAT_REWARDS = {"xmlcount": xmlcount_format_reward, "derivation": derivation_format_reward}


def format_rewards(completions: list[str], name: str) -> list[float]:
    """The format reward ``name`` (one of ``FORMAT_REWARDS``) of each completion."""
    if name not in FORMAT_REWARDS:
        raise ValueError(f"unknown format reward {name!r}; valid: {sorted(FORMAT_REWARDS)}")
    return [FORMAT_REWARDS[name](text) for text in completions]
