"""The Row: one dataset item shared by every VLM stage (SFT, RL, eval).

A Row is a plain ``dict`` (so it survives DataLoader collation, pickling and
Lightning checkpoints untouched) with the fields below. ``validate_row`` checks
one and raises an error that names the offending row.
"""

from __future__ import annotations

from typing import Any, TypedDict

from PIL import Image


class Row(TypedDict, total=False):
    """One dataset item (see /tmp contract and docs/data.md).

    Required: id, task, images, problem, answer, steps, key_steps, expert_trace,
    difficulty, needs_image. Optional extras used by the "steps" solution style:
    image_description, rationale. Multiple-choice rows also carry choices (the option
    texts, lettered A, B, ... in the problem) and answer_text (the gold option's text;
    answer is then its letter). system_prompt: this row's system turn (a data config's).
    assistant_prefix: text the assistant turn starts with (a prefill the policy continues; HBPO's budgets).
    """

    id: str
    task: str
    images: list[Image.Image]
    problem: str
    answer: str
    steps: list[str]
    key_steps: list[list[str]]
    expert_trace: str | None
    difficulty: int
    needs_image: bool
    image_description: str
    rationale: str
    choices: list[str]
    answer_text: str
    system_prompt: str
    assistant_prefix: str


ROW_FIELDS: tuple[str, ...] = (
    "id",
    "task",
    "images",
    "problem",
    "answer",
    "steps",
    "key_steps",
    "expert_trace",
    "difficulty",
    "needs_image",
)


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message names the row (index and id)."""


def describe_row(index: int | None, row_id: Any) -> str:
    """Human-readable row reference used in every error message, e.g. ``row 3 (id='a7')``."""
    where = f"row {index}" if index is not None else "row"
    return f"{where} (id={row_id!r})"


def validate_row(row: dict[str, Any], index: int | None = None, *, image_count: int | None = None) -> None:
    """Raise ``BadRowError`` naming the row if ``row`` is not a well-formed Row.

    Checks presence and types of all contract fields, that images are PIL images,
    that problem and answer are non-empty, and that difficulty is 1..3. ``image_count``:
    the row's images are not decoded yet (lazy loading) and number this many; their
    type is checked when they are decoded.
    """
    ref = describe_row(index, row.get("id"))
    missing = [f for f in ROW_FIELDS if f not in row]
    if missing:
        raise BadRowError(f"{ref}: missing field(s) {missing}")
    if not isinstance(row["id"], str) or not row["id"]:
        raise BadRowError(f"{ref}: 'id' must be a non-empty string")
    if not isinstance(row["images"], list) or not all(isinstance(im, Image.Image) for im in row["images"]):
        raise BadRowError(f"{ref}: 'images' must be a list of PIL images")
    for field in ("problem", "answer"):
        if not isinstance(row[field], str) or not row[field].strip():
            raise BadRowError(f"{ref}: '{field}' is empty or not a string")
    if not isinstance(row["steps"], list) or not all(isinstance(s, str) for s in row["steps"]):
        raise BadRowError(f"{ref}: 'steps' must be a list of strings")
    groups = row["key_steps"]
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and g and all(isinstance(s, str) for s in g) for g in groups
    ):
        raise BadRowError(f"{ref}: 'key_steps' must be a list of non-empty lists of strings")
    if row["expert_trace"] is not None and not isinstance(row["expert_trace"], str):
        raise BadRowError(f"{ref}: 'expert_trace' must be a string or None")
    if row["difficulty"] not in (1, 2, 3):
        raise BadRowError(f"{ref}: 'difficulty' must be 1, 2 or 3, got {row['difficulty']!r}")
    if not isinstance(row["needs_image"], bool):
        raise BadRowError(f"{ref}: 'needs_image' must be a bool")
    if row["needs_image"] and not (row["images"] if image_count is None else image_count):
        raise BadRowError(f"{ref}: needs_image is True but the row has no image")
