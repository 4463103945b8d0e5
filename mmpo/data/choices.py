"""Multiple-choice rows: options in the prompt (lettered A, B, C, ...) and the gold letter.

The options block follows MathVista's ``query`` layout, which is what most published
multiple-choice prompts look like::

    <question>
    Choices:
    (A) 3/11
    (B) 8/11

The gold answer may be given as the option's text or as its letter; it is stored as the
letter (what the prompt asks for), with the option text kept beside it for scoring.
"""

from __future__ import annotations

import json
import string
from typing import Any

from mmpo.data.schema import BadRowError

LETTERS = string.ascii_uppercase
CHOICES_HEADER = "Choices:"


def parse_choices(value: Any, ref: str) -> list[str]:
    """Option texts from a list (or a JSON string of a list); None or empty means no options."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRowError(f"{ref}: choices {text[:80]!r} is neither a list nor a JSON list ({exc})") from exc
    if not isinstance(value, (list, tuple)):
        raise BadRowError(f"{ref}: choices must be a list of strings, got {type(value).__name__}")
    options = [str(option).strip() for option in value]
    if any(not option for option in options):
        raise BadRowError(f"{ref}: choices contain an empty option: {options}")
    if len(options) > len(LETTERS):
        raise BadRowError(f"{ref}: {len(options)} choices; at most {len(LETTERS)} can be lettered")
    return options


def format_choices(options: list[str]) -> str:
    """The options block: ``Choices:`` then one ``(A) text`` line per option."""
    return "\n".join([CHOICES_HEADER, *(f"({LETTERS[k]}) {option}" for k, option in enumerate(options))])


def lists_options(prompt: str, options: list[str]) -> bool:
    """Whether ``prompt`` already lists every option with its letter: ``(A) text``, ``A. text``,
    ``A) text`` or ``A: text`` (MathVista's ``query`` does). The letter is required: an option's
    bare text ("2") is often part of the question itself."""
    return all(
        any(form.format(letter=LETTERS[k], option=option) in prompt
            for form in ("({letter}) {option}", "{letter}. {option}", "{letter}) {option}", "{letter}: {option}"))
        for k, option in enumerate(options)
    )


def prompt_with_choices(prompt: str, options: list[str]) -> str:
    """``prompt`` followed by the options block, unless the prompt already lists them, so options
    are never shown twice."""
    if not options or lists_options(prompt, options):
        return prompt
    return f"{prompt}\n{format_choices(options)}"


def gold_letter(answer: str, options: list[str], ref: str) -> tuple[str, str]:
    """``(letter, option text)`` of the gold answer, given as an option's text or as its letter.

    Option text is matched first (exactly, then ignoring case and surrounding space and
    parentheses), so an option that is itself a letter is read as text; then a letter
    (``B``, ``(B)``, ``b``). Anything else raises ``BadRowError`` naming the row.
    """
    cleaned = answer.strip()
    for k, option in enumerate(options):
        if cleaned == option:
            return LETTERS[k], option
    folded = cleaned.strip("()").strip().casefold()
    for k, option in enumerate(options):
        if folded == option.casefold():
            return LETTERS[k], option
    if len(folded) == 1 and folded.upper() in LETTERS[: len(options)]:
        k = LETTERS.index(folded.upper())
        return LETTERS[k], options[k]
    raise BadRowError(
        f"{ref}: answer {answer!r} is neither one of the choices {options} nor a letter "
        f"A-{LETTERS[len(options) - 1]}"
    )
