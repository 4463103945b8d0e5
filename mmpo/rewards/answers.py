"""Extracting the final answer from a completion and checking it against the gold answer.

Extraction order: the last ``<answer>...</answer>`` block (a ``\\boxed{}`` inside it
wins), else the last ``\\boxed{...}``, else the line after R1-VL's
``### The final answer is:`` header. Checking: normalised string equality first;
word answers ("left", "red") are checked by string only, because math-verify would
read them as products of symbols ("left" == "felt"); everything else goes through
math-verify ``parse``/``verify``.

Model output is hostile input: every scan here is linear in the text's length (one pass
or ``str.find`` loops, no regex that re-scans the rest of the text from each match
start), and an answer longer than :data:`MAX_ANSWER_CHARS` is never handed to math-verify.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator

from math_verify import parse, verify

from mmpo.rewards.log_text import MAX_LOGGED_CHARS, TruncatingFilter

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_BOXED_START_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FINAL_HEADER = "### The final answer is:"
_WORD_RE = re.compile(r"^[a-z][a-z \-']*$")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# Greedy group then one closing bracket: a single linear pass (a lazy group followed by
# ``\s*`` would retry the trailing spaces from every position).
_BRACKETED_RE = re.compile(r"[(\[]\s*([a-z][a-z \-']*)[)\]]")

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own (signal-based) timeout per parse / verify, used on a main thread only.

Reward functions run in the reward worker process's main thread (``mmpo.rewards.worker``),
so this timeout is live there; it scores a slow answer 0 and the rest of the batch normally.
The worker's per-call deadline (``compute_rewards``' ``timeout_s``) is the backstop for
anything it cannot interrupt."""

MAX_ANSWER_CHARS = 1000
"""Longest extracted answer that is checked. A longer "answer" is scored wrong without being
parsed: no gold answer is that long, and math-verify's parse time grows with the length."""

# math-verify logs the whole unparsed answer on a parse timeout; keep the log readable.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(TruncatingFilter(MAX_LOGGED_CHARS))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.

    Linear in ``len(text)``: one pass pairs every ``{`` with the ``}`` that closes it (a stack
    of open positions), then the last ``\\boxed{`` whose brace is closed wins.
    """
    starts = [m.end() for m in _BOXED_START_RE.finditer(text)]
    if not starts:
        return None
    closing: dict[int, int] = {}  # position of "{" -> position of its "}"
    open_positions: list[int] = []
    for pos, char in enumerate(text):
        if char == "{":
            open_positions.append(pos)
        elif char == "}" and open_positions:
            closing[open_positions.pop()] = pos
    for start in reversed(starts):
        end = closing.get(start - 1)
        if end is not None:
            return text[start:end]
    return None


def tag_blocks(text: str, open_tag: str, close_tag: str) -> Iterator[str]:
    """Contents of the ``open_tag...close_tag`` blocks, read left to right without overlap (as
    ``re.findall(open + "(.*?)" + close)`` would). Linear: each ``find`` moves on; the regex
    re-scans to the end of the text from every unclosed ``open_tag``."""
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return
        yield text[start + len(open_tag):end]
        pos = end + len(close_tag)


def extract_answer(completion: str) -> str | None:
    """The final answer written in ``completion``, or None if it gives none.

    Example: ``"<think>..</think><answer>3</answer>"`` -> ``"3"``;
    ``"so \\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``.
    """
    block = None
    for block in tag_blocks(completion, _ANSWER_OPEN, _ANSWER_CLOSE):
        pass  # keep the last one
    if block is not None:
        content = block.strip()
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
    bracketed = _BRACKETED_RE.fullmatch(text)
    return bracketed.group(1).rstrip() if bracketed else text


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

    A ``predicted`` longer than :data:`MAX_ANSWER_CHARS` is wrong. math-verify's internal
    timeouts use ``signal.alarm``, which only works on a main thread: they are on there
    (including in the reward worker process) and off elsewhere, where the caller bounds the time.
    """
    if predicted is None or not predicted.strip() or len(predicted) > MAX_ANSWER_CHARS:
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


_EXPRESSION_CHARS = frozenset("0123456789+-*() ")


def uses_exactly(expression: str, numbers: list[int]) -> bool:
    """True when ``expression`` is made of integers, ``+ - * ( )`` and spaces only and its integers are
    ``numbers`` (as a multiset: each used exactly once). One linear scan. Example:
    ``uses_exactly("(3 + 5) * 7", [3, 5, 7])`` -> True; ``"22"`` or ``"3 * 5 + 7 + 1"`` -> False."""
    if len(expression) > MAX_ANSWER_CHARS or not expression.strip() or set(expression) - _EXPRESSION_CHARS:
        return False
    found: list[int] = []
    digits = ""
    for char in expression + " ":
        if char.isdigit():
            digits += char
        elif digits:
            found.append(int(digits))
            digits = ""
    return sorted(found) == sorted(int(n) for n in numbers)


def row_answer_correct(predicted: str | None, row: dict) -> bool:
    """Whether ``predicted`` answers ``row``: :func:`answers_match` against ``row["answer"]``; for a
    countdown-style row (``numbers`` and ``target``, ``mmpo.data.synthetic.text_tasks.countdown``) the
    predicted expression must use exactly the row's numbers (:func:`uses_exactly`) and math-verify must
    find it equal to the target."""
    numbers = row.get("numbers")
    if numbers is not None and row.get("target") is not None:
        if predicted is None or not uses_exactly(predicted, list(numbers)):
            return False
        return answers_match(predicted, str(row["target"]))
    return answers_match(predicted, str(row["answer"]))
