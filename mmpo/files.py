"""Output files that are never half-written: temp file in the same directory + ``os.replace``.

A reader sees either the old file or the complete new one, never a partial file at the final
path (``os.replace`` is atomic within one filesystem, hence the temp file beside the target).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

#: errnos that mean "no room left": the device is full or the user's quota is
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A save ran out of disk space (ENOSPC / EDQUOT); ``filename`` is the file being written."""

    def __str__(self) -> str:
        return (f"disk full: no space left to write {self.filename}; the files saved before are kept. "
                "Free space, then resume (--ckpt_path CHECKPOINT)")


def is_disk_full(error: BaseException) -> bool:
    """True when ``error`` or an exception it was raised from is an out-of-space error.

    ``torch.save`` reports a full disk as ``RuntimeError: ... unexpected pos N vs M`` with the real
    ``OSError(ENOSPC)`` only in the chain; safetensors only in its message.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE_ERRNOS:
            return True
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full_error(error: BaseException, path: str | os.PathLike[str]) -> DiskFullError | None:
    """A ``DiskFullError`` naming ``path`` when ``error`` is an out-of-space error (else None)."""
    if isinstance(error, DiskFullError):
        return error
    if not is_disk_full(error):
        return None
    full = DiskFullError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    full.__cause__ = error
    return full


def partial_path(path: str | Path) -> Path:
    """The temp name a write of ``path`` goes to first: hidden, beside it, unique per process."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


@contextlib.contextmanager
def atomic_outputs(*paths: str | Path) -> Iterator[list[Path]]:
    """Yield temp paths for ``paths``; on success move each onto its target in the given order.

    On an exception the temp files are removed and the targets are left as they were; running out of
    space raises ``DiskFullError`` naming the target(s).
    """
    targets = [Path(path) for path in paths]
    temps = [partial_path(path) for path in targets]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield temps
        for temp, target in zip(temps, targets):
            os.replace(temp, target)
    except OSError as error:
        raise disk_full_error(error, targets[0] if len(targets) == 1 else ", ".join(map(str, targets))) or error
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
