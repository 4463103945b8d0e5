"""Registry of synthetic visual reasoning tasks and the deterministic item factory.

A task is a function ``generate(rng, difficulty, image_size) -> dict`` returning the
content fields of a Row (images, problem, answer, steps, key_steps, needs_image and
optionally image_description, rationale). ``make_items`` adds id, task, difficulty
and expert_trace, and assigns every generated item to exactly one split by a hash of
its content (problem, answer, image pixels). Train, val and test therefore never
share an item, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from mmpo.data.schema import Row, validate_row
from mmpo.data.solution import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT, render_solution

TaskFn = Callable[[random.Random, int, int], dict[str, Any]]

DEFAULT_IMAGE_SIZE = 56
"""Default image side in pixels: 4 x 4 patches of 14 px, i.e. 4 visual tokens after Qwen's 2x2 merge."""

SPLIT_BUCKETS: dict[str, range] = {"train": range(0, 80), "val": range(80, 90), "test": range(90, 100)}
"""Content-hash bucket (0..99) owned by each split: 80 / 10 / 10 percent of the item space."""

DIFFICULTIES: tuple[int, ...] = (1, 2, 3)

TASKS: list[str] = []
"""Names of the registered tasks, in registration order."""

_GENERATORS: dict[str, TaskFn] = {}

_MAX_ATTEMPTS = 2000


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator registering ``generate(rng, difficulty, image_size) -> dict`` as task ``name``.

    The dict must hold ``images`` (list of PIL RGB images), ``problem``, ``answer``,
    ``steps`` (list[str]), ``key_steps`` (list of groups of equivalent strings; the
    first string of each group must appear in the steps) and ``needs_image``.
    A duplicate name fails loudly.
    """

    def decorator(fn: TaskFn) -> TaskFn:
        if name in _GENERATORS:
            raise ValueError(f"task {name!r} is already registered; registered: {TASKS}")
        _GENERATORS[name] = fn
        TASKS.append(name)
        return fn

    return decorator


def get_task(name: str) -> TaskFn:
    """The generator of a registered task; an unknown name lists the valid ones."""
    try:
        return _GENERATORS[name]
    except KeyError:
        raise KeyError(f"unknown synthetic task {name!r}; registered: {TASKS}") from None


def content_bucket(item: dict[str, Any]) -> int:
    """Stable bucket 0..99 from the item's problem, answer and image pixels (sha256)."""
    digest = hashlib.sha256()
    digest.update(item["problem"].encode())
    digest.update(b"\0" + item["answer"].encode())
    for image in item["images"]:
        digest.update(b"\0" + f"{image.size}".encode())
        digest.update(image.tobytes())
    return int.from_bytes(digest.digest()[:8], "big") % 100


def make_items(
    task: str,
    n: int,
    *,
    seed: int,
    difficulty: int | None = None,
    split: str = "train",
    image_size: int = DEFAULT_IMAGE_SIZE,
) -> list[Row]:
    """Generate ``n`` Rows of ``task``, deterministic by (task, seed, split, difficulty, image_size).

    Args:
        task: a name in ``TASKS``.
        n: number of items.
        seed: random seed.
        difficulty: 1..3, or None to cycle 1, 2, 3, 1, ... (balanced levels).
        split: "train", "val" or "test"; splits are disjoint by content hash.
        image_size: image side in pixels (multiples of 28 avoid processor resizing).

    Returns:
        list of Rows; ids are ``"{task}-{split}-s{seed}-{i}"``.
    """
    generate = get_task(task)
    if split not in SPLIT_BUCKETS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLIT_BUCKETS)}")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None, got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # String seeds are hashed with sha512 by random.Random: stable across processes.
    rng = random.Random(f"{task}|{seed}|{split}|{difficulty}|{image_size}")
    buckets = SPLIT_BUCKETS[split]
    rows: list[Row] = []
    for i in range(n):
        level = difficulty if difficulty is not None else DIFFICULTIES[i % len(DIFFICULTIES)]
        for _ in range(_MAX_ATTEMPTS):
            content = generate(rng, level, image_size)
            if content_bucket(content) in buckets:
                break
        else:
            raise RuntimeError(
                f"task {task!r} produced no {split!r} item in {_MAX_ATTEMPTS} attempts "
                f"(difficulty {level}); its item space is too small for this split"
            )
        row: Row = {"id": f"{task}-{split}-s{seed}-{i}", "task": task, "difficulty": level, **content}
        row.setdefault("expert_trace", None)
        if row["expert_trace"] is None:
            row["expert_trace"] = render_solution(row)
        validate_row(row, i)
        rows.append(row)
    return rows


def corpus(tasks: list[str] | None = None, n: int = 200, seed: int = 0) -> list[str]:
    """All texts a tokenizer must cover: system prompts, problems, and solutions in both styles.

    Uses ``n`` items per task from each split (train, val, test) so held-out items
    tokenize as well as training ones.

    Returns:
        list of strings (duplicates removed, order stable).
    """
    texts: list[str] = [SYSTEM_PROMPT, STEPS_SYSTEM_PROMPT]
    for task in tasks if tasks is not None else list(TASKS):
        for split in SPLIT_BUCKETS:
            for row in make_items(task, n, seed=seed, split=split):
                texts += [row["problem"], render_solution(row, "think-answer"), render_solution(row, "steps")]
    return list(dict.fromkeys(texts))
