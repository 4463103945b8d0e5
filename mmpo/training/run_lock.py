"""One run per checkpoint directory, and ``last.ckpt`` is always the newest run's.

``DirectoryLock`` takes ``fcntl.flock`` on ``<dir>/.lock`` and writes who holds it (pid, host,
start time, command). The kernel drops a flock when its process dies, so a lock left by a killed
run is simply taken over; a live holder makes the next run fail at once with its pid and command.

``RunDirectoryLock`` is the Lightning callback that every ``mmpo fit`` Trainer gets: it locks each
``ModelCheckpoint`` directory in ``on_fit_start`` (once Lightning has resolved the directories and
restored any checkpoint, before the first step can write one), removes the temporary files and
staging directories that killed saves left there, and releases the locks in
``teardown`` / ``on_exception``. Under the lock (from ``on_train_start``, once every strategy has
restored its checkpoint) it also keeps ``last.ckpt`` the newest: Lightning
would write a fresh run's last checkpoint as ``last-v1.ckpt`` beside an earlier run's
``last.ckpt`` (so ``--ckpt_path .../last.ckpt`` resumed the old run); instead, the earlier run's
``last`` files are moved into ``<dir>/earlier-<time>/`` (nothing deleted) and this run writes
``last.ckpt``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.training.checkpoint import previous_path, remove_stale_temporaries, sidecar_path

LOCK_NAME = ".lock"


class RunDirectoryLockedError(RuntimeError):
    """Another live process is writing this run directory."""


def _holder_description(lock_file: Path) -> str:
    try:
        holder = json.loads(lock_file.read_text() or "{}")
    except (OSError, ValueError):
        holder = {}
    if not holder:
        return "another process (it has not written its details yet)"
    command = holder.get("command", "?")
    if holder.get("host") == socket.gethostname():
        # The live command line, when the holder runs on this machine.
        try:
            command = Path(f"/proc/{holder['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, KeyError):
            pass
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (started "
            f"{holder.get('started', '?')}), command: {command}")


class DirectoryLock:
    """An exclusive, non-blocking lock on a directory, held until ``release`` or process exit."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.lock_file = self.directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise ``RunDirectoryLockedError`` naming the holder."""
        if self.held:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirectoryLockedError(
                    f"{self.directory} is in use by another run: {_holder_description(self.lock_file)}. "
                    "Wait for it to finish, stop it, or write this run elsewhere.") from None
            # The holder we waited on may have unlinked the file after we opened it: lock the current one.
            try:
                same_file = os.stat(self.lock_file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlink while still holding the lock, so that nobody is left holding a lock on a removed file.
        self.lock_file.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _last_file_name(checkpoint: ModelCheckpoint) -> str | None:
    name = checkpoint.CHECKPOINT_NAME_LAST
    # A last name templated with metrics is new at every save and never versioned against an old run.
    return None if not checkpoint.save_last or "{" in name else name + checkpoint.FILE_EXTENSION


def keep_last_newest(checkpoint: ModelCheckpoint, resumed_from: str | None) -> Path | None:
    """Move an earlier run's ``last.ckpt`` (and sidecar, ``.prev``) aside so this run writes ``last.ckpt``.

    Lightning keeps a ``last.ckpt`` it did not write in this run and versions the new one
    (``last-v1.ckpt``). Nothing moves when this run resumes from it or already owns it.
    Returns the folder the files went to, or None.
    """
    name = _last_file_name(checkpoint)
    if name is None or checkpoint.dirpath is None:
        return None
    last = Path(checkpoint.dirpath) / name
    if not (last.exists() or last.is_symlink()):
        return None
    owned = {os.path.abspath(p) for p in (checkpoint.last_model_path, resumed_from) if p}
    if os.path.abspath(last) in owned:
        return None
    aside = last.parent / time.strftime("earlier-%Y%m%d-%H%M%S", time.localtime(last.lstat().st_mtime))
    aside.mkdir(exist_ok=True)
    for path in (last, sidecar_path(last), previous_path(last), sidecar_path(previous_path(last))):
        if path.exists() or path.is_symlink():
            os.replace(path, aside / path.name)
    warnings.warn(f"{last} was written by an earlier run; moved it to {aside}/ so that this run's "
                  f"{name} is the newest (resume the earlier run with --ckpt_path {aside / name})", stacklevel=2)
    return aside


class RunDirectoryLock(Callback):
    """Lock every ModelCheckpoint directory for the duration of ``fit``; keep ``last.ckpt`` the newest."""

    def __init__(self) -> None:
        self._locks: dict[str, DirectoryLock] = {}

    def _lock(self, directory: str | os.PathLike[str]) -> None:
        key = os.path.abspath(directory)
        if key not in self._locks:
            lock = DirectoryLock(key)
            lock.acquire()
            self._locks[key] = lock

    def _checkpoint_dirs(self, trainer: Any) -> list[str]:
        return [cb.dirpath for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # Not in setup: ModelCheckpoint.setup runs after ours and would warn about our lock file.
        if not trainer.is_global_zero:
            return
        for directory in self._checkpoint_dirs(trainer):
            self._lock(directory)
            # under the lock no other run writes here: what a killed save left behind can go
            for stale in remove_stale_temporaries(directory):
                warnings.warn(f"removed {stale}, left by an interrupted save", stacklevel=2)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Not in on_fit_start: a strategy that restores after setup (FSDP2Strategy, Lightning's
        # ModelParallelStrategy) has not read the checkpoint yet there, so trainer.ckpt_path (the
        # last.ckpt being resumed, which must stay) is still unset. No checkpoint is written before this.
        if not trainer.is_global_zero:
            return
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, ModelCheckpoint):
                keep_last_newest(checkpoint, trainer.ckpt_path)

    def release(self) -> None:
        for lock in self._locks.values():
            lock.release()
        self._locks.clear()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.release()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.release()
