"""Output files that are never half-written: temp file in the same directory + ``os.replace``.

A reader sees either the old file or the complete new one, never a partial file at the final
path (``os.replace`` is atomic within one filesystem, hence the temp file beside the target).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator


def partial_path(path: str | Path) -> Path:
    """The temp name a write of ``path`` goes to first: hidden, beside it, unique per process."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


@contextlib.contextmanager
def atomic_outputs(*paths: str | Path) -> Iterator[list[Path]]:
    """Yield temp paths for ``paths``; on success move each onto its target in the given order.

    On an exception the temp files are removed and the targets are left as they were.
    """
    targets = [Path(path) for path in paths]
    temps = [partial_path(path) for path in targets]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield temps
        for temp, target in zip(temps, targets):
            os.replace(temp, target)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (flushed to disk before the rename)."""
    with atomic_outputs(path) as (temp,):
        with open(temp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    return Path(path)


def atomic_write_json(path: str | Path, data: Any, *, indent: int | None = 1) -> Path:
    """Write ``data`` as JSON (``json.dumps(data, indent=indent)``) to ``path`` atomically; returns the path.

    A killed run never leaves half a file: a reader sees the old file or the complete new one."""
    return atomic_write_text(path, json.dumps(data, indent=indent))


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (streamed; ~1 s per GB)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
