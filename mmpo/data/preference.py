"""Preference pairs for DPO / INPO / DR-PO: (image(s), prompt, chosen, rejected).

A preference row is a prompt row (``id``, ``images``, ``problem``, optional ``system_prompt``,
and ``answer`` when the data has one) plus two completion strings, ``chosen`` (preferred) and
``rejected``. Two sources:

- local files (``load_preference_rows``): jsonl / json / parquet / arrow / ``save_to_disk``, with
  the prompt datasets' column overrides (``ColumnKeys``: ``prompt_key``, ``image_key``,
  ``answer_key``, ``choices_key``, ``system_prompt``, ``format_prompt``) plus ``chosen_key`` /
  ``rejected_key`` (default ``chosen`` / ``rejected``). A completion is a string or TRL's
  conversational form (a list of ``{"role", "content"}`` messages: the last assistant turn's text).
  The answer column is optional here (preference data rarely has one).
- the synthetic tasks (``synthetic_preference_row``): chosen = the rendered reference solution,
  rejected = the same reasoning ending in a wrong answer (``wrong_answer``), so a pair differs
  where correctness is decided.

Images of file rows are decoded when the file is loaded (preference sets are small; the lazy
path of ``mmpo.data.loaders.open_rows`` is for large prompt sets).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from mmpo.data.choices import prompt_with_choices
from mmpo.data.format_prompt import apply_format_prompt
from mmpo.data.images import as_image_list, open_image
from mmpo.data.loaders import (
    _ID_COLUMNS,
    _PLACEHOLDER_RE,
    DEFAULT_IMAGE_KEYS,
    ColumnKeys,
    _choices,
    _first_key,
    _prompt_key,
    _unwrap_boxed,
    iter_records,
    split_path_spec,
)
from mmpo.data.schema import BadRowError, describe_row
from mmpo.data.solution import render_solution

PreferenceRow = dict[str, Any]

# "left or right", "the red one or the blue one", "on the left or the right"
_ALTERNATIVES_RE = re.compile(r"(?:the )?(\w+)(?: one)? or (?:the )?(\w+)")


def wrong_answer(row: dict[str, Any], rng: random.Random) -> str:
    """A plausible wrong answer for a synthetic / choice row.

    Integers: the answer plus one of -2, -1, 1, 2 (kept >= 0 for a non-negative answer); countdown
    expressions: the same numbers with one operator changed so the target is missed; multiple choice: another letter;
    "A or B" questions: the other alternative. Raises ValueError for anything else.
    """
    answer = str(row["answer"]).strip()
    if row.get("numbers") is not None and row.get("target") is not None:
        return _wrong_expression(answer, int(row["target"]), rng)
    if re.fullmatch(r"-?\d+", answer):
        value = int(answer)
        candidates = [value + d for d in (-2, -1, 1, 2) if value + d >= 0 or value < 0]  # negatives stay
        return str(rng.choice(candidates))
    if row.get("choices"):
        letters = [chr(ord("A") + k) for k in range(len(row["choices"]))]
        return rng.choice([letter for letter in letters if letter != answer])
    match = _ALTERNATIVES_RE.search(str(row["problem"]))
    if match and answer in match.groups():
        first, second = match.groups()
        return second if answer == first else first
    raise ValueError(f"row {row.get('id')!r}: cannot make a wrong answer for {answer!r} (not an integer, a choice "
                     "letter, or one of two alternatives named in the problem)")


def _evaluate_expression(expression: str) -> int:
    """Value of an integer expression of ``+ - *`` and parentheses (parsed with ``ast``, nothing else runs)."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"not an integer +, -, * expression: {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


def _wrong_expression(expression: str, target: int, rng: random.Random) -> str:
    """A countdown answer that uses the same numbers but misses the target: one operator of ``expression``
    swapped for another (the first swap, in random order, whose value differs)."""
    positions = [i for i, char in enumerate(expression) if char in "+-*" and (i == 0 or expression[i - 1] == " ")]
    candidates = [expression[:i] + op + expression[i + 1:] for i in positions for op in "+-*" if op != expression[i]]
    rng.shuffle(candidates)
    for candidate in candidates:
        if _evaluate_expression(candidate) != target:
            return candidate
    raise ValueError(f"cannot make a wrong countdown answer from {expression!r}")


def wrong_solution(row: dict[str, Any], wrong: str, style: str = "think-answer") -> str:
    """The reference reasoning with its conclusion changed to ``wrong``: the gold answer in the last
    step is replaced (as a whole word); a last step without it gets ``So the answer is <wrong>.``"""
    steps = [s for s in row.get("steps") or [] if s and s.strip()]
    gold = re.escape(str(row["answer"]).strip())
    pattern = re.compile(rf"(?<![\w.]){gold}(?![\w])")
    if steps and pattern.search(steps[-1]):
        steps[-1] = pattern.sub(wrong, steps[-1])
    else:
        steps.append(f"So the answer is {wrong}.")
    return render_solution({**row, "steps": steps, "answer": wrong}, style=style)


def synthetic_preference_row(row: dict[str, Any], seed: int, style: str = "think-answer") -> PreferenceRow:
    """``row`` plus ``chosen`` (its reference solution) and ``rejected`` (a wrong conclusion);
    the wrong answer is a function of (seed, row id) only."""
    rng = random.Random(f"{seed}:{row['id']}")
    return {**row, "chosen": render_solution(row, style=style),
            "rejected": wrong_solution(row, wrong_answer(row, rng), style=style)}


def completion_text(value: Any, ref: str, key: str) -> str:
    """A completion column: a string, or TRL's conversational list of messages (the last
    assistant message's text; content may be a string or a list of ``{"type": "text"}`` parts)."""
    if isinstance(value, list):
        turns = [m for m in value if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        if not turns:
            raise BadRowError(f"{ref}: column {key!r} is a message list without an assistant turn")
        content = turns[-1].get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        value = content
    if not isinstance(value, str) or not value.strip():
        raise BadRowError(f"{ref}: column {key!r} must be a non-empty string or message list, got {value!r:.80}")
    return value


def preference_row(record: dict[str, Any], index: int, *, source: str, root: Path, keys: ColumnKeys,
                   chosen_key: str = "chosen", rejected_key: str = "rejected") -> PreferenceRow:
    """One raw record -> a preference row (images decoded); BadRowError names the row and the columns."""
    columns = list(record)
    id_key = _first_key(record, _ID_COLUMNS)
    row_id = str(record[id_key]) if id_key else f"{source}-{index}"
    ref = describe_row(index, row_id)
    problem = _PLACEHOLDER_RE.sub("", str(record[_prompt_key(record, keys.prompt_key, ref, columns)])).strip()
    if not problem:
        raise BadRowError(f"{ref}: problem is empty after removing image placeholders")
    options = _choices(record, keys, ref, columns)
    if options:
        problem = prompt_with_choices(problem, options)
    if keys.format_prompt is not None:
        problem = apply_format_prompt(keys.format_prompt, problem)
    for key in (chosen_key, rejected_key):
        if key not in record:
            raise BadRowError(f"{ref}: no column {key!r} (chosen_key / rejected_key); the dataset has columns "
                              f"{sorted(columns)}")
    image_key = keys.image_key or _first_key(record, DEFAULT_IMAGE_KEYS)
    images = [open_image(v, root, ref) for v in as_image_list(record.get(image_key) if image_key else None)]
    row: PreferenceRow = {
        "id": row_id, "task": str(record.get("task") or source), "images": images, "problem": problem,
        "chosen": completion_text(record[chosen_key], ref, chosen_key),
        "rejected": completion_text(record[rejected_key], ref, rejected_key),
        "needs_image": bool(images),
    }
    answer_key = keys.answer_key or "answer"
    if keys.answer_key is not None and answer_key not in record:
        raise BadRowError(f"{ref}: no column {answer_key!r} (answer_key); the dataset has columns {sorted(columns)}")
    if record.get(answer_key) is not None and str(record[answer_key]).strip():
        row["answer"] = _unwrap_boxed(str(record[answer_key]))
    if keys.system_prompt is not None:
        row["system_prompt"] = keys.system_prompt
    return row


def load_preference_rows(
    path: str | Path,
    *,
    keys: ColumnKeys = ColumnKeys(),
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    image_root: str | Path | None = None,
    split: str | None = None,
    skip_bad_rows: bool = False,
) -> tuple[list[PreferenceRow], dict[str, Any]]:
    """Preference rows of a local file or folder (formats and ``folder@split`` as ``load_rows``).

    Returns ``(rows, stats)`` with stats ``{"total", "loaded", "skipped", "errors"}``; a bad row
    raises ``BadRowError`` naming it, or with ``skip_bad_rows`` is skipped and counted.
    """
    path, split = split_path_spec(path, split)
    root = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    rows: list[PreferenceRow] = []
    errors: list[str] = []
    seen: set[str] = set()
    total = 0
    for index, record in enumerate(iter_records(path, split=split)):
        total += 1
        try:
            if "__bad_json__" in record:
                raise BadRowError(f"{describe_row(index, None)}: invalid JSON at {record['__bad_json__']}")
            row = preference_row(dict(record), index, source=path.stem or "data", root=root, keys=keys,
                                 chosen_key=chosen_key, rejected_key=rejected_key)
            if row["id"] in seen:
                raise BadRowError(f"{describe_row(index, row['id'])}: duplicate id")
        except BadRowError as exc:
            if not skip_bad_rows:
                raise BadRowError(f"{path}: {exc}") from exc
            errors.append(str(exc))
            continue
        seen.add(row["id"])
        rows.append(row)
    return rows, {"total": total, "loaded": len(rows), "skipped": len(errors), "errors": errors}
