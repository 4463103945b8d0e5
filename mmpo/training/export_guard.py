"""An export directory belongs to one run: never overwrite another run's export silently.

Each training run has an id (a random hex string, kept in its Lightning checkpoints so that a
resumed run keeps it). Every export writes ``mmpo_run.json`` with that id beside the weights.
Before training starts and before each export, :func:`check_export_target` refuses a directory
that holds another run's export, or files without a marker, unless ``overwrite`` is set.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

MARKER_NAME = "mmpo_run.json"
CHECKPOINT_KEY = "mmpo_run_id"


class OutputDirInUseError(ValueError):
    """The export directory holds another run's output."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def export_owner(output_dir: str | Path) -> str | None:
    """The run id recorded in ``output_dir``'s marker, or None when there is no marker."""
    marker = Path(output_dir) / MARKER_NAME
    if not marker.is_file():
        return None
    try:
        return str(json.loads(marker.read_text())["run_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise OutputDirInUseError(f"{marker} is unreadable ({exc}); it is not clear which run wrote {output_dir}") from exc


def check_export_target(output_dir: str | Path, run_id: str, *, overwrite: bool, setting: str) -> None:
    """Raise :class:`OutputDirInUseError` if ``output_dir`` holds files of another run.

    ``setting`` names the switch that allows overwriting (shown in the message).
    """
    path = Path(output_dir)
    if overwrite or not path.is_dir() or not any(path.iterdir()):
        return
    owner = export_owner(path)
    if owner == run_id:
        return
    what = f"the export of another run (run id {owner})" if owner else f"files and no {MARKER_NAME} marker"
    raise OutputDirInUseError(
        f"output directory {path} holds {what}; refusing to overwrite it. Choose another output directory, "
        f"or set {setting}=true to overwrite it."
    )


def write_run_marker(output_dir: str | Path, run_id: str) -> Path:
    """Record ``run_id`` as the owner of ``output_dir`` (atomic: temp file + rename)."""
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{MARKER_NAME}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"run_id": run_id}, handle)
        os.replace(tmp, path / MARKER_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path / MARKER_NAME


class ExportOwnershipMixin:
    """LightningModule mixin (before LightningModule in the bases): the run's id travels in its
    checkpoints, and its export directory is claimed before training and at every export.

    The host provides ``export_dir()`` (None: no export) and may have an ``overwrite_output``
    hyperparameter. Hooks call ``super()`` so other mixins' checkpoint hooks still run.
    """

    overwrite_setting = "model.init_args.overwrite_output"

    def export_dir(self) -> str | Path | None:
        raise TypeError(f"{type(self).__name__} must define export_dir() to use ExportOwnershipMixin")

    @property
    def run_id(self) -> str:
        """This run's id: new for a fresh run, the checkpoint's after a resume."""
        if getattr(self, "_run_id", None) is None:
            self._run_id = new_run_id()
        return self._run_id

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = self.run_id
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if CHECKPOINT_KEY in checkpoint:
            self._run_id = checkpoint[CHECKPOINT_KEY]
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]

    def on_train_start(self) -> None:
        # after a resume has restored the run id, before the first step: fail now, not at the export
        self.claim_export_dir(self.export_dir())
        super().on_train_start()  # type: ignore[misc]

    def claim_export_dir(self, output_dir: str | Path | None) -> None:
        """Refuse ``output_dir`` if it holds another run's files (global rank 0 decides; it writes)."""
        trainer = getattr(self, "_trainer", None)
        if output_dir is None or (trainer is not None and not trainer.is_global_zero):
            return
        hparams = getattr(self, "hparams", {})
        check_export_target(output_dir, self.run_id, overwrite=bool(hparams.get("overwrite_output", False)),
                            setting=self.overwrite_setting)

    def mark_export_dir(self, output_dir: str | Path) -> None:
        write_run_marker(output_dir, self.run_id)
