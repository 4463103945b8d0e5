"""Answer extraction and scoring rules shared by the named benchmarks.

Every benchmark row carries a ``scoring`` dict: ``{"rule": <name>, ...parameters}``; :func:`judge`
returns ``(extracted answer, score)`` for one completion. Rules:

* ``choice``: multiple choice; the answer may be the letter (``B``, ``(B)``, ``B. 12``) or the
  option's text (``12``, or an expression math-verify finds equal to the option); parameters
  ``choices`` (option texts, possibly empty when only letters are known) and ``gold`` (a letter).
* ``mathvista``: MathVista's ``normalize_extracted_answer`` + ``safe_equal`` (evaluation/
  calculate_score.py in lupantech/MathVista): multi_choice -> ``choice``; integer -> ``str(int(x))``;
  float -> ``str(round(x, precision))``; list / text -> string equality. ``unit`` is stripped first.
* ``math``: free-form answers: normalised string equality or math-verify equivalence
  (:func:`mmpo.rewards.answers.answers_match`), then the numbers with units/degree signs stripped.
* ``relaxed``: ChartQA's relaxed accuracy (pix2struct's ``relaxed_correctness``): numbers within
  5 % relative error of a non-zero target (``"x%"`` read as ``x/100``), otherwise case-insensitive
  exact match.
* ``number``: GSM8K: the numeric value equals the gold number (commas, ``$`` stripped); when no
  marked answer exists, the last number in the completion (lm-eval's "flexible-extract").

With no marked answer (:func:`final_answer_text`), multiple choice and MathVista's numeric questions
fall back to :func:`answer_at_the_end` (their prompts ask for the answer at the end).

A completion with no answer found scores 0 (no random guess, unlike MMMU's official parser).
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Callable, Mapping, Sequence

from mmpo.rewards.answers import MATH_VERIFY_TIMEOUT_S, MAX_ANSWER_CHARS, answers_match, extract_answer, normalize_text

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_DIRECT_ANSWER_CHARS = 40
"""A completion with no answer markers counts as a direct answer when it is one line this short."""

# "the answer is X" / "Answer: X" / GSM8K's "#### X": the text after the LAST marker, to the line's end.
_MARKERS = ("####", "final answer:", "final answer is", "answer:", "answer is")
_LETTER_RE = re.compile(r"\(?\s*(?:option\s+)?([A-Za-z])\s*\)?(?:\s*[.:)]\s*(.*))?", re.IGNORECASE | re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# "5 cm", "12.5 m^2", "3 square units": a number followed by unit words only.
# Unit words after the first must be space-separated: "(\s*[a-z]+)+" would backtrack exponentially.
_NUMBER_WITH_UNITS_RE = re.compile(
    r"(-?\d[\d,]*(?:\.\d+)?)\s*[a-zA-Z]+(?:\^\{?\d\}?)?(?:\s+[a-zA-Z]+(?:\^\{?\d\}?)?)*")
_DEGREE_RE = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree|\\circ")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")


def _after_last_marker(completion: str) -> str | None:
    lowered = completion.lower()
    best, best_end = -1, -1
    for marker in _MARKERS:
        position = lowered.rfind(marker)
        if position > best:
            best, best_end = position, position + len(marker)
    if best < 0:
        return None
    line = completion[best_end:].lstrip(" :\t*").split("\n", 1)[0].strip().strip("*").strip()
    line = line.rstrip(".").strip()
    if line.startswith("$") and line.endswith("$") and len(line) > 1:
        line = line.strip("$").strip()
    return line or None


def final_answer_text(completion: str) -> str | None:
    """The final answer a completion states, or None ("no answer").

    Order: ``<answer>..</answer>`` / ``\\boxed{}`` / R1-VL's header (the RL reward's extraction),
    then the text after the last "answer is" / "Answer:" / "####", then the whole completion
    when it is a single short line (a model answering directly, e.g. ``B`` or ``12``).
    """
    answer = extract_answer(completion)
    if answer:
        return answer
    answer = _after_last_marker(completion)
    if answer:
        return answer
    stripped = completion.strip()
    if stripped and "\n" not in stripped and len(stripped) <= MAX_DIRECT_ANSWER_CHARS:
        return stripped.rstrip(".").strip() or None
    return None


def _plain(text: str) -> str:
    """Text with ``\\text{}`` unwrapped, ``$`` dropped, lower-cased and spaces collapsed (for comparing options)."""
    return normalize_text(_TEXT_WRAP_RE.sub(r"\1", text))


def match_choice(answer: str | None, choices: Sequence[str]) -> int | None:
    """Index of the option ``answer`` names, by option text or by letter; None if it names none.

    With an empty ``choices`` (options only in the image) any letter A-Z is accepted.
    Example: ``match_choice("(B)", ["3", "4"])`` -> 1; ``match_choice("4", ["3", "4"])`` -> 1.
    """
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return None
    plain = _plain(answer)
    for index, choice in enumerate(choices):
        if plain == _plain(str(choice)):
            return index
    letter_match = _LETTER_RE.fullmatch(_TEXT_WRAP_RE.sub(r"\1", answer).replace("$", "").strip())
    if letter_match:
        index = LETTERS.index(letter_match.group(1).upper())
        if not choices or index < len(choices):
            return index
    for index, choice in enumerate(choices):
        if answers_match(answer, str(choice)):
            return index
    return None


def strip_unit(text: str, unit: str | None = None) -> str:
    """``text`` without ``$``, ``\\text{}`` wrappers, degree signs, a trailing ``unit`` (or, after a
    number, any trailing unit words: ``5 cm`` -> ``5``) and a final period."""
    text = _TEXT_WRAP_RE.sub(r"\1", text).replace("$", "").strip()
    text = _DEGREE_RE.sub("", text).strip().rstrip(".").strip()
    if unit and unit.strip() and text.lower().endswith(unit.strip().lower()):
        text = text[: len(text) - len(unit.strip())].strip()
    with_units = _NUMBER_WITH_UNITS_RE.fullmatch(text)
    return with_units.group(1) if with_units else text


def to_number(text: str | None) -> float | None:
    """The number ``text`` is (``1,000`` -> 1000.0, ``25%`` -> 25.0, ``\\frac{1}{2}`` -> 0.5), else None."""
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("\\%", "").replace("%", "").replace("\\!", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        value = _latex_number(cleaned)
    return value if value is not None and math.isfinite(value) else None


def _latex_number(text: str) -> float | None:
    """A numeric LaTeX expression's value via math-verify's parser (``\\frac{1}{2}``, ``2\\sqrt{3}``)."""
    if not text or len(text) > 100 or not re.search(r"\d", text):
        return None
    from math_verify import parse

    # math-verify's timeout is signal-based: live on the main thread only (as in mmpo.rewards.answers).
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        parsed = parse(f"${text}$", parsing_timeout=timeout)
        value = float(parsed[0]) if parsed else None
    except (TypeError, ValueError, AttributeError, IndexError):
        return None
    return value


def _numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ----------------------------------------------------------------------------- rules


def score_choice(answer: str | None, params: Mapping[str, Any]) -> tuple[str | None, float]:
    choices = list(params.get("choices") or [])
    index = match_choice(answer, choices)
    if index is None:
        return answer, 0.0
    return LETTERS[index], float(LETTERS[index] == str(params["gold"]).strip().upper())


def mathvista_normalize(answer: str, params: Mapping[str, Any]) -> str | None:
    """MathVista's ``normalize_extracted_answer`` for free-form answers (after stripping the unit)."""
    text = strip_unit(answer, params.get("unit"))
    answer_type = params.get("answer_type")
    if answer_type == "integer":
        value = to_number(text)
        return str(int(value)) if value is not None else None
    if answer_type == "float":
        value = to_number(text)
        precision = params.get("precision")
        return str(round(value, int(precision or 0))) if value is not None else None
    if answer_type == "list":
        return re.sub(r"\s+", "", text)
    return text


def score_mathvista(answer: str | None, params: Mapping[str, Any]) -> tuple[str | None, float]:
    if params.get("question_type") == "multi_choice":
        return score_choice(answer, params)
    if answer is None:
        return None, 0.0
    normalized = mathvista_normalize(answer, params)
    gold = str(params["gold"]).strip()
    if params.get("answer_type") == "list":
        gold = re.sub(r"\s+", "", gold)
    elif params.get("answer_type") == "text":
        return normalized, float(normalized is not None and normalized.lower() == gold.lower())
    return normalized, float(normalized == gold)


def score_math(answer: str | None, params: Mapping[str, Any]) -> tuple[str | None, float]:
    if answer is None:
        return None, 0.0
    gold = str(params["gold"])
    if answers_match(answer, gold):
        return answer, 1.0
    unit = params.get("unit")
    return answer, float(_numbers_equal(to_number(strip_unit(answer, unit)), to_number(strip_unit(gold, unit))))


def relaxed_correctness(prediction: str, target: str, max_relative_change: float = 0.05) -> bool:
    """pix2struct's ChartQA metric: 5 % relative tolerance for numbers (target != 0), else exact match."""

    def as_float(text: str) -> float | None:
        try:
            return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
        except ValueError:
            return None

    prediction_value, target_value = as_float(prediction), as_float(target)
    if prediction_value is not None and target_value:
        return abs(prediction_value - target_value) / abs(target_value) <= max_relative_change
    return prediction.lower() == target.lower()


def score_relaxed(answer: str | None, params: Mapping[str, Any]) -> tuple[str | None, float]:
    if answer is None:
        return None, 0.0
    prediction = answer.strip().rstrip(".").strip()
    return prediction, float(relaxed_correctness(prediction, str(params["gold"]).strip()))


def score_number(answer: str | None, params: Mapping[str, Any], completion: str = "") -> tuple[str | None, float]:
    if answer is None or to_number(strip_unit(answer).lstrip("$")) is None:
        numbers = _NUMBER_RE.findall(completion)
        answer = numbers[-1] if numbers else answer
    if answer is None:
        return None, 0.0
    value = to_number(strip_unit(answer).lstrip("$"))
    return answer, float(_numbers_equal(value, to_number(str(params["gold"]))))


RULES: dict[str, Callable[..., tuple[str | None, float]]] = {
    "choice": score_choice,
    "mathvista": score_mathvista,
    "math": score_math,
    "relaxed": score_relaxed,
}


_TRAILING_LETTER_RE = re.compile(r"(?:^|[\s(])([A-Z])\)?[.!]?\s*$")


def answer_at_the_end(completion: str, params: Mapping[str, Any]) -> str | None:
    """For prompts that ask for the answer "at the end" (MathVista, MathVerse, MMMU): the last line's
    trailing option letter (``Therefore, B.``) for multiple choice, or its last number otherwise."""
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1][-MAX_ANSWER_CHARS:]
    if params["rule"] == "choice" or params.get("question_type") == "multi_choice":
        letter = _TRAILING_LETTER_RE.search(last)
        return letter.group(1) if letter else None
    if params["rule"] == "mathvista" and params.get("answer_type") in ("integer", "float"):
        numbers = _NUMBER_RE.findall(last)
        return numbers[-1] if numbers else None
    return None


def judge(completion: str, row: Mapping[str, Any]) -> tuple[str | None, float]:
    """``(extracted answer, score in {0, 1})`` of ``completion`` under ``row["scoring"]``."""
    params = row["scoring"]
    answer = final_answer_text(completion) or answer_at_the_end(completion, params)
    if params["rule"] == "number":
        return score_number(answer, params, completion)
    if params["rule"] not in RULES:
        raise ValueError(f"row {row.get('id')!r}: unknown scoring rule {params['rule']!r}; valid: "
                         f"{sorted([*RULES, 'number'])}")
    return RULES[params["rule"]](answer, params)
