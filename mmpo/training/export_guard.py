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
