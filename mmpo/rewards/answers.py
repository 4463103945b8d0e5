"""Extracting the final answer from a completion and checking it against the gold answer.

Extraction order: the last ``<answer>...</answer>`` block (a ``\\boxed{}`` inside it
wins), else the last ``\\boxed{...}``, else the line after R1-VL's
``### The final answer is:`` header. Checking: normalised string equality first;
word answers ("left", "red") are checked by string only, because math-verify would
read them as products of symbols ("left" == "felt"); everything else goes through
math-verify ``parse``/``verify``.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FINAL_HEADER = "### The final answer is:"
_WORD_RE = re.compile(r"^[a-z][a-z \-']*$")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own (signal-based) timeout, used only on the main thread."""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos]
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer written in ``completion``, or None if it gives none.

    Example: ``"<think>..</think><answer>3</answer>"`` -> ``"3"``;
    ``"so \\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``.
    """
    blocks = _ANSWER_RE.findall(completion)
    if blocks:
        content = blocks[-1].strip()
        boxed = last_boxed(content)
        content = boxed.strip() if boxed is not None else content
        return content or None
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip() or None
    if _FINAL_HEADER in completion:
        tail = completion.rsplit(_FINAL_HEADER, 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        return line or None
    return None


def normalize_text(answer: str) -> str:
    """Lower-case, unwrap ``\\text{}`` and brackets around a word, drop ``$``, spaces and a trailing period."""
    text = _TEXT_WRAP_RE.sub(r"\1", answer)
    text = text.replace("$", "").strip().lower()
    text = re.sub(r"\s+", " ", text).rstrip(".").strip()
    # A choice letter or word in brackets: "(A)" -> "a".
    bracketed = re.fullmatch(r"[(\[]\s*([a-z][a-z \-']*?)\s*[)\]]", text)
    return bracketed.group(1) if bracketed else text


def is_word_answer(answer: str) -> bool:
    """True for answers made of letters only (after normalisation), e.g. "left", "red"."""
    return bool(_WORD_RE.match(normalize_text(answer)))


def _parse(text: str, timeout: int | None) -> list:
    # Read the text as one LaTeX expression first: bare "\sqrt{12}" parses to nothing and
    # "2\sqrt{3}" to 2 without the $...$ anchor. Fall back to math-verify's free-text search.
    parsed = parse(f"${text}$", parsing_timeout=timeout)
    if not parsed:
        parsed = parse(text, parsing_timeout=timeout)
    return parsed


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether ``predicted`` (an extracted answer) equals ``gold``.

    math-verify's internal timeouts use ``signal.alarm``, which only works on the main
    thread; off the main thread they are disabled and the caller bounds the time
    (``compute_rewards`` runs reward functions in a worker thread with a deadline).
    """
    if predicted is None or not predicted.strip():
        return False
    if normalize_text(predicted) == normalize_text(gold):
        return True
    if is_word_answer(gold):
        return False
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = _parse(gold, timeout)
    pred_parsed = _parse(predicted, timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
