"""``mmpo`` with faults injected from the environment, for black-box tests of what a cluster does to a run.

    MMPO_TEST_FAULT='{"kind": ..., ...}' python tests/reliability/fault_runner.py fit -c CONFIG ...

Kinds (one per run):
- ``wait_for_signal``: at the end of step ``step`` write the file ``marker`` and wait (up to 120 s) until a stop
  signal has arrived, so that the test's signal lands at a known step;
- ``pause_last_save``: as ``wait_for_signal``, and then, in the save of ``last.ckpt`` that the signal
  causes, write ``paused`` just before the new file is renamed into place and wait for the file ``resume``
  (the test sends a second signal meanwhile);
- ``exit_after_replace``: ``os._exit(137)`` (no clean-up, like SIGKILL) right after the ``nth`` ``os.replace``
  onto a file named ``name``;
- ``enospc_at_save``: the ``nth`` checkpoint temporary file is opened on ``/dev/full``, so the kernel answers
  its writes with ENOSPC, as a full disk does.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

KILLED_STATUS = 137


def _wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


class WaitForSignalAtStep(Callback):
    """Hold the run at the end of step ``step`` until a stop signal arrived (the test sends it)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.marker.write_text(str(os.getpid()))
            _wait_for(lambda: trainer.received_sigterm)


def _install(fault: dict[str, Any]) -> None:
    kind = fault["kind"]
    if kind in ("wait_for_signal", "pause_last_save"):
        from mmpo.training.cli_support import MMPOLightningCLI

        build = MMPOLightningCLI.instantiate_trainer

        def instantiate_trainer(self, **kwargs):
            trainer = build(self, **kwargs)
            trainer.callbacks.append(WaitForSignalAtStep(fault["step"], fault["marker"]))
            return trainer

        MMPOLightningCLI.instantiate_trainer = instantiate_trainer
    if kind == "pause_last_save":
        from mmpo.training.preemption import received_stop_signal

        replace = os.replace

        def paused_replace(source, target, *args, **kwargs):
            if Path(target).name == "last.ckpt" and received_stop_signal() is not None:
                Path(fault["paused"]).write_text("paused")
                _wait_for(lambda: Path(fault["resume"]).exists(), 60.0)
            return replace(source, target, *args, **kwargs)

        os.replace = paused_replace
    elif kind == "exit_after_replace":
        replace, seen = os.replace, [0]

        def exiting_replace(source, target, *args, **kwargs):
            replace(source, target, *args, **kwargs)
            if Path(target).name == fault["name"]:
                seen[0] += 1
                if seen[0] == fault["nth"]:
                    os._exit(KILLED_STATUS)

        os.replace = exiting_replace
    elif kind == "enospc_at_save":
        real_open, seen = builtins.open, [0]
        temporary = re.compile(r"^\..+\.ckpt\.\d+\.tmp$")

        def full_disk_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and "w" in mode and temporary.match(Path(file).name):
                seen[0] += 1
                if seen[0] == fault["nth"]:
                    Path(file).touch()  # the temporary exists, as it would on a full disk
                    return real_open("/dev/full", mode, *args, **kwargs)
            return real_open(file, mode, *args, **kwargs)

        builtins.open = full_disk_open
    elif kind not in ("wait_for_signal",):
        raise ValueError(f"unknown fault kind {kind!r}")


if __name__ == "__main__":
    _install(json.loads(os.environ["MMPO_TEST_FAULT"]))
    from mmpo.cli import main

    sys.exit(main(sys.argv[1:]))
