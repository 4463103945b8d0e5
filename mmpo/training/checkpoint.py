"""Checkpoints that are written atomically and never load silently when damaged.

``VerifiedCheckpointIO`` is a Lightning ``CheckpointIO`` plugin (a ``TorchCheckpointIO``):

- **save**: ``torch.save`` to a temporary file in the same directory, fsync; the file it replaces,
  when it verifies, gets a second name ``<name>.prev.ckpt`` (hard link) with its own sidecar (one
  previous good checkpoint to fall back to); ``os.replace`` over the old file, then
  ``<name>.ckpt.sha256`` beside it (``sha256sum -c`` format, run in the directory). At every instant
  of a save one of ``<name>.ckpt`` / ``<name>.prev.ckpt`` verifies. A save that raises leaves the old
  file untouched and no partial file; a full disk raises ``DiskFullError`` naming the file.
- **load**: the file's sha256 must match its sidecar; a file without one (older mmpo versions)
  loads with a warning. The weights and optimizer state must be finite. A damaged checkpoint
  raises ``CorruptCheckpointError`` naming the file and the newest good checkpoint beside it.
- **remove**: the checkpoint, its sidecar and its ``.prev`` copy go together.
"""

from __future__ import annotations

import os
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mmpo.files import DiskFullError, disk_full_error, file_sha256, is_disk_full  # noqa: F401 - re-exported

SIDECAR_SUFFIX = ".sha256"
PREVIOUS_TAG = ".prev"
#: what a save writes first (hidden, ``.NAME.<pid>.tmp``), removed at the start of the next run when a kill left it
TEMPORARY_SUFFIX = ".tmp"
#: FSDP2Strategy's staging directory of a sharded save (``.NAME.staging``)
STAGING_SUFFIX = ".staging"
# Entries of a Lightning checkpoint that feed the weights: a NaN/inf here poisons the model. Callback
# state is left out on purpose (ModelCheckpoint stores +-inf as its initial best score).
FINITE_KEYS = ("state_dict", "optimizer_states")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed verification (checksum, readability or finite values)."""


def sidecar_path(path: _PATH) -> Path:
    """``last.ckpt`` -> ``last.ckpt.sha256``."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def previous_path(path: _PATH) -> Path:
    """``last.ckpt`` -> ``last.prev.ckpt``: the copy a save keeps of the file it replaces."""
    path = Path(path)
    return path.with_name(path.stem + PREVIOUS_TAG + path.suffix)


def checksum_status(path: _PATH) -> str:
    """``"ok"``, ``"missing"`` (no sidecar) or ``"mismatch"`` for a checkpoint file.

    A symlink (``ModelCheckpoint(save_last="link")``) is checked against its target's sidecar.
    """
    path = Path(path)
    # A link's own sidecar may be stale (Lightning replaces a saved last.ckpt by a link without telling the IO).
    sidecar = sidecar_path(path.resolve() if path.is_symlink() else path)
    if not sidecar.is_file():
        return "missing"
    recorded = sidecar.read_text().split()
    return "ok" if recorded and recorded[0] == file_sha256(path) else "mismatch"


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_sidecar(path: Path, digest: str) -> None:
    """``NAME.sha256`` holding ``digest  NAME`` (so ``sha256sum -c`` run in the directory checks ``path``)."""
    sidecar = sidecar_path(path)
    temporary = sidecar.with_name(f".{sidecar.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    with open(temporary, "w") as handle:
        handle.write(f"{digest}  {path.name}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, sidecar)


def _keep_as_previous(path: Path, digest: str) -> None:
    """Make ``<name>.prev.ckpt`` a second name of ``path``'s verified bytes, with its own sidecar.

    A hard link, so nothing is copied and ``path`` never disappears; filesystems without hard links get a
    copy. While the previous file is being swapped, ``path`` itself still verifies.
    """
    previous = previous_path(path)
    linked = previous.with_name(f".{previous.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    linked.unlink(missing_ok=True)
    try:
        os.link(path, linked)
    except OSError:  # no hard links here (some network filesystems): copy the bytes
        shutil.copyfile(path, linked)
        with open(linked, "rb+") as handle:
            os.fsync(handle.fileno())
    os.replace(linked, previous)
    _write_sidecar(previous, digest)


def atomic_torch_save(checkpoint: dict[str, Any], path: _PATH, *, keep_previous: bool = True) -> Path:
    """Write ``checkpoint`` to ``path`` atomically with its sha256 sidecar; returns the path.

    The order keeps a verifiable checkpoint at every instant, whatever moment a kill lands on:

    1. the new bytes go to a temporary file beside ``path`` and are fsynced;
    2. with ``keep_previous``, a ``path`` that verifies becomes also ``<name>.prev.ckpt`` (hard link + its
       own sidecar) - ``path`` still verifies throughout;
    3. the temporary file is renamed over ``path`` (now ``path`` mismatches its old sidecar, and the
       ``.prev`` copy is the one that verifies), then ``path``'s new sidecar is renamed into place.

    A damaged ``path`` is never kept as ``.prev`` (the good ``.prev`` stays). Running out of space
    raises ``DiskFullError`` naming ``path``, with the files as they were.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    try:
        try:
            with open(temporary, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
        except (OSError, RuntimeError) as error:
            raise disk_full_error(error, path) or error
        digest = file_sha256(temporary)
        if keep_previous and path.is_file() and not path.is_symlink():
            old_digest = _recorded_digest(path)
            if old_digest is not None and old_digest == file_sha256(path):
                _keep_as_previous(path, old_digest)
        os.replace(temporary, path)
        _write_sidecar(path, digest)
        _fsync_directory(path.parent)
    except OSError as error:
        raise disk_full_error(error, path) or error
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _recorded_digest(path: Path) -> str | None:
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return None
    recorded = sidecar.read_text().split()
    return recorded[0] if recorded else None


def remove_stale_temporaries(directory: _PATH) -> list[Path]:
    """Delete what interrupted saves left in ``directory``; returns what was removed.

    Temporary checkpoint and sidecar files (``.NAME.<pid>.tmp``), ``mmpo.files`` partial files and FSDP2
    staging directories (``.NAME.staging``). Call it only while holding the directory's run lock.
    """
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        name = entry.name
        stale = name.startswith(".") and (name.endswith(TEMPORARY_SUFFIX) or ".partial-" in name
                                          or name.endswith(STAGING_SUFFIX))
        if not stale:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{index}]")


def first_non_finite(checkpoint: dict[str, Any], keys: tuple[str, ...] = FINITE_KEYS) -> str | None:
    """Name of the first floating-point tensor under ``keys`` holding NaN or inf, else None."""
    for key in keys:
        for name, tensor in _tensors(checkpoint.get(key), key):
            if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
                return name
    return None


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    # What torch.load raises on a truncated or scrambled zip archive (not weights_only refusals).
    return (RuntimeError, EOFError, zipfile.BadZipFile, ValueError)


def _mismatch_reason(path: _PATH) -> str:
    return f"its sha256 does not match {sidecar_path(path).name} (bytes changed after it was written)"


def _unreadable_reason(error: BaseException) -> str:
    first_line = (str(error).splitlines() or [""])[0][:200]
    return f"it cannot be read ({error.__class__.__name__}: {first_line})"


def checkpoint_problem(path: _PATH, *, unverifiable_is_problem: bool = True) -> str | None:
    """Why ``path`` is not a good checkpoint (``None`` when it is).

    Checksummed files are judged by their checksum; files without a sidecar are loaded
    (``weights_only=True``) and checked for finite values. A file that loads only without
    ``weights_only`` counts as a problem unless ``unverifiable_is_problem`` is False.
    """
    status = checksum_status(path)
    if status == "ok":
        return None
    if status == "mismatch":
        return _mismatch_reason(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except _unreadable_errors() as error:
        return _unreadable_reason(error)
    except Exception as error:  # noqa: BLE001 - any other refusal also means "not usable as is"
        return f"it cannot be verified ({error.__class__.__name__})" if unverifiable_is_problem else None
    bad = first_non_finite(checkpoint)
    return None if bad is None else f"{bad} holds NaN or inf"


def _sharded_problem(directory: Path) -> str | None:
    from mmpo.training.fsdp import manifest_problem  # fsdp imports this module

    problem = manifest_problem(directory)
    return "it has no manifest to verify it by" if problem == "missing" else problem


def newest_good_checkpoint(directory: _PATH, *, exclude: _PATH | None = None) -> Path | None:
    """The most recently written ``*.ckpt`` in ``directory`` that verifies.

    Files must pass ``checkpoint_problem``; FSDP2 sharded checkpoints (directories) must match their
    ``SHA256SUMS`` manifest.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    excluded = Path(exclude).absolute() if exclude is not None else None
    candidates = [p for p in directory.glob("*.ckpt") if (p.is_file() or p.is_dir()) and p.absolute() != excluded]
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        problem = _sharded_problem(candidate) if candidate.is_dir() else checkpoint_problem(candidate)
        if problem is None:
            return candidate
    return None


def corrupt_checkpoint_error(path: _PATH, reason: str) -> CorruptCheckpointError:
    """The refusal message: the file, why, and the newest good checkpoint to use instead."""
    good = newest_good_checkpoint(Path(path).parent, exclude=path)
    hint = (f"The newest good checkpoint is {good}; resume from it (e.g. --ckpt_path {good})."
            if good is not None else f"No good checkpoint was found in {Path(path).parent}.")
    return CorruptCheckpointError(f"checkpoint {path} is damaged and was not loaded: {reason}. {hint}")


def refuse_if_damaged(path: _PATH) -> None:
    """Raise ``CorruptCheckpointError`` when ``path`` is damaged (checksum, unreadable, NaN/inf).

    For code that reads a checkpoint before the Trainer does (LightningCLI reads its hyperparameters).
    """
    problem = checkpoint_problem(path, unverifiable_is_problem=False)
    if problem is not None:
        raise corrupt_checkpoint_error(path, problem)


def select_resume_checkpoint(last: _PATH) -> Path | None:
    """``last`` when it is good; else the newest good checkpoint beside it, with a warning naming both.

    Returns None when ``last`` does not exist. Raises ``CorruptCheckpointError`` when ``last`` is
    damaged and nothing good is left beside it.
    """
    last = Path(last)
    if not last.exists():
        return None
    problem = _sharded_problem(last) if last.is_dir() else checkpoint_problem(last)
    if problem is None:
        return last
    fallback = newest_good_checkpoint(last.parent, exclude=last)
    if fallback is None:
        raise corrupt_checkpoint_error(last, problem)
    warnings.warn(f"checkpoint {last} is damaged ({problem}); resuming from the previous good checkpoint "
                  f"{fallback} instead", stacklevel=2)
    return fallback


def resolve_resume_path(requested: _PATH) -> tuple[Path, str | None]:
    """The checkpoint a resume from ``requested`` should load, and the one line saying why when it differs.

    ``requested`` when it verifies (or has no checksum to check: older versions). When it is missing
    or damaged - a kill during a save can leave ``last.ckpt`` newer than its sidecar, or gone - the
    newest verifiable checkpoint in its directory is used instead. With nothing verifiable there,
    ``requested`` is returned unchanged (a damaged one is then refused when loaded, a missing one
    reported missing).
    """
    requested = Path(requested)
    if requested.is_dir():
        problem = _sharded_problem(requested) if (requested / "SHA256SUMS").is_file() else None
    elif requested.is_file():
        problem = checkpoint_problem(requested, unverifiable_is_problem=False)
    else:
        problem = "it does not exist"
    if problem is None:
        return requested, None
    fallback = newest_good_checkpoint(requested.parent, exclude=requested)
    if fallback is None:
        return requested, None
    return fallback, (f"checkpoint {requested} cannot be used ({problem}); resuming from the newest verifiable "
                      f"checkpoint beside it, {fallback}")


class VerifiedCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic writes, sha256 sidecars, one kept previous file and verified loads."""

    def __init__(self, *, keep_previous: bool = True) -> None:
        super().__init__()
        self.keep_previous = keep_previous

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_torch_save(checkpoint, path, keep_previous=self.keep_previous)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        status = checksum_status(path) if Path(path).exists() else "missing"
        if status == "mismatch":
            raise corrupt_checkpoint_error(path, _mismatch_reason(path))
        if status == "missing" and Path(path).exists():
            warnings.warn(f"checkpoint {path} has no {SIDECAR_SUFFIX} checksum beside it (written by an older "
                          "version?); loading it with finite-value checks only", stacklevel=2)
        try:
            checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except _unreadable_errors() as error:
            raise corrupt_checkpoint_error(path, _unreadable_reason(error)) from error
        bad = first_non_finite(checkpoint)
        if bad is not None:
            raise corrupt_checkpoint_error(path, f"{bad} holds NaN or inf")
        return checkpoint

    def remove_checkpoint(self, path: _PATH) -> None:
        for target in (Path(path), previous_path(path)):
            super().remove_checkpoint(target)
            sidecar_path(target).unlink(missing_ok=True)


def install_verified_checkpoint_io(trainer: Any) -> None:
    """Use ``VerifiedCheckpointIO`` for a Trainer built with Lightning's default ``TorchCheckpointIO``.

    A user-chosen CheckpointIO plugin (any other class) is left alone.
    """
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = VerifiedCheckpointIO()
