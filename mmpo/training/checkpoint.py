"""Checkpoints that are written atomically and never load silently when damaged.

``VerifiedCheckpointIO`` is a Lightning ``CheckpointIO`` plugin (a ``TorchCheckpointIO``):

- **save**: ``torch.save`` to a temporary file in the same directory, fsync, keep the file it
  replaces as ``<name>.prev.ckpt`` when that one verifies (one previous good checkpoint to fall
  back to), ``os.replace`` into place, then write ``<name>.ckpt.sha256`` beside it
  (``sha256sum -c`` format). A save that raises leaves the old file untouched and no partial file.
- **load**: the file's sha256 must match its sidecar; a file without one (older mmpo versions)
  loads with a warning. The weights and optimizer state must be finite. A damaged checkpoint
  raises ``CorruptCheckpointError`` naming the file and the newest good checkpoint beside it.
- **remove**: the checkpoint, its sidecar and its ``.prev`` copy go together.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mmpo.files import file_sha256

SIDECAR_SUFFIX = ".sha256"
PREVIOUS_TAG = ".prev"
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
    sidecar = sidecar_path(path)
    temporary = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as handle:
        handle.write(f"{digest}  {path.name}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, sidecar)


def _move_with_sidecar(source: Path, target: Path) -> None:
    os.replace(source, target)
    if sidecar_path(source).is_file():
        os.replace(sidecar_path(source), sidecar_path(target))


def atomic_torch_save(checkpoint: dict[str, Any], path: _PATH, *, keep_previous: bool = True) -> Path:
    """Write ``checkpoint`` to ``path`` atomically with its sha256 sidecar; returns the path.

    With ``keep_previous`` the file being replaced becomes ``<name>.prev.ckpt`` when it verifies
    (a damaged one is overwritten, so the good ``.prev`` is never replaced by a bad file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        digest = file_sha256(temporary)
        if path.is_file() and not path.is_symlink() and keep_previous and checksum_status(path) == "ok":
            _move_with_sidecar(path, previous_path(path))
        else:
            # The old sidecar describes the old bytes; never leave it next to the new ones.
            sidecar_path(path).unlink(missing_ok=True)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _write_sidecar(path, digest)
    _fsync_directory(path.parent)
    return path


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


def newest_good_checkpoint(directory: _PATH, *, exclude: _PATH | None = None) -> Path | None:
    """The most recently written ``*.ckpt`` in ``directory`` that passes ``checkpoint_problem``."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    excluded = Path(exclude).absolute() if exclude is not None else None
    candidates = [p for p in directory.glob("*.ckpt") if p.is_file() and p.absolute() != excluded]
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if checkpoint_problem(candidate) is None:
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
    problem = checkpoint_problem(last)
    if problem is None:
        return last
    fallback = newest_good_checkpoint(last.parent, exclude=last)
    if fallback is None:
        raise corrupt_checkpoint_error(last, problem)
    warnings.warn(f"checkpoint {last} is damaged ({problem}); resuming from the previous good checkpoint "
                  f"{fallback} instead", stacklevel=2)
    return fallback


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
