"""Answer extraction, the correctness reward and format rewards for text completions.

IGPO's trigger (arXiv 2509.10396; official code) looks only at the correctness reward.
Our completions end with ``A:<number>`` (see ``mmpo.dllm.task``); real-checkpoint prompts may
answer in ``\\boxed{...}``. Integers are compared exactly; anything else falls back to
math-verify (the project's answer checker) so ``1/2`` and ``0.5`` agree.

Format rewards are added to the correctness reward (IGPO's official run: xmlcount + 3.0 x
correct) but never trigger hinting: the all-wrong test looks at correctness alone.

Training scores through :func:`correctness_rewards_with_deadline`, which runs the check in the
reward worker process (``mmpo.rewards.worker``) so that an answer math-verify cannot finish
(``10^{10^{10^{10}}}``) costs one failed, counted batch instead of a hung run.
"""

from __future__ import annotations

import functools
import logging
import re

from mmpo.dllm.task import ANSWER_PREFIX
from mmpo.rewards.answers import MAX_ANSWER_CHARS
from mmpo.rewards.log_text import shorten
from mmpo.rewards.worker import CallOutcome, WorkerUnavailable, get_reward_worker

logger = logging.getLogger(__name__)

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


def _canonical_int(text: str) -> str:
    # Compared as digit strings: int() refuses numbers over 4300 digits, which a model can write.
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


class VerifierError(ValueError):
    """math-verify raised on an answer (unparsable): scored wrong, and counted."""


def _check(completion: str, answer: str) -> bool:
    """Whether the completion's answer equals ``answer``; raises VerifierError if math-verify fails."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    gold = str(answer).strip()
    if _INT_RE.fullmatch(predicted) and _INT_RE.fullmatch(gold):
        return _canonical_int(predicted) == _canonical_int(gold)
    if len(predicted) > MAX_ANSWER_CHARS:  # never handed to math-verify (its parse time grows with it)
        return False
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${predicted}$")))
    except Exception as exc:
        raise VerifierError(f"math-verify failed on {shorten(predicted)!r}: {type(exc).__name__}") from exc


def is_correct(completion: str, answer: str) -> bool:
    """Whether ``completion``'s extracted answer equals the reference ``answer`` (an answer
    math-verify cannot read is wrong; :func:`score_correctness` also counts those)."""
    try:
        return _check(completion, answer)
    except VerifierError:
        return False


def score_correctness(completions: list[str], answers: list[str], *, correct: float = 1.0) -> tuple[list[float], int]:
    """``correct`` for each right answer, 0.0 otherwise, and how many answers math-verify raised on."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    scores, verifier_errors = [], 0
    for completion, answer in zip(completions, answers):
        try:
            scores.append(correct if _check(completion, answer) else 0.0)
        except VerifierError:
            scores.append(0.0)
            verifier_errors += 1
    return scores, verifier_errors


def correctness_rewards(completions: list[str], answers: list[str], *, correct: float = 1.0) -> list[float]:
    """``correct`` for each right answer, 0.0 otherwise (IGPO's trigger reward; it uses 3.0)."""
    return score_correctness(completions, answers, correct=correct)[0]


def correctness_rewards_with_deadline(
    completions: list[str], answers: list[str], *, correct: float = 1.0, timeout_s: float | None = 10.0
) -> tuple[list[float], dict[str, float]]:
    """:func:`correctness_rewards` run in the reward worker process within ``timeout_s`` seconds.

    A call that raises or misses the deadline (the worker is then killed and replaced) scores
    every completion 0.0 and is counted. ``timeout_s=None`` scores inline.

    Returns:
        ``(scores, metrics)``; metrics: ``rewards/correct/errors`` and ``rewards/correct/timeouts``
        (0 or 1 per call), ``rewards/correct/verify_errors`` (answers math-verify raised on) and
        ``perf/reward_worker_restarts`` (reward workers killed or found dead so far).
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    score = functools.partial(score_correctness, correct=correct)
    outcome = None
    if timeout_s is not None:
        try:
            outcome = get_reward_worker().run([("correct", score)], (completions, answers), timeout_s)["correct"]
        except WorkerUnavailable as exc:
            logger.warning("correctness scored in this process, without a hard deadline: %s", shorten(str(exc)))
    if outcome is None or outcome.unloadable:
        # No deadline asked, or no worker: score here (math-verify's own timeout still applies
        # on the main thread) rather than lose the batch.
        outcome = CallOutcome(value=score(completions, answers))
    if outcome.error is not None:
        logger.warning("correctness scoring failed, every completion of this batch scores 0: %s",
                       shorten(outcome.error))
        scores, verifier_errors = [0.0] * len(completions), 0
    else:
        scores, verifier_errors = outcome.value
    metrics = {
        "rewards/correct/errors": float(outcome.error is not None),
        "rewards/correct/timeouts": float(outcome.timed_out),
        "rewards/correct/verify_errors": float(verifier_errors),
        "perf/reward_worker_restarts": float(get_reward_worker().restarts),
    }
    return scores, metrics


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
    """Format of the synthetic arithmetic derivation (``mmpo.dllm.task``), at most 0.75.

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
