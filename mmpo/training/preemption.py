"""Preemption: a stop signal ends the run at a step boundary with ``last.ckpt`` saved and a distinct exit code.

A cluster stops a job with SIGTERM (SLURM, Kubernetes) or warns it with SIGUSR1 (SLURM's
``--signal=USR1@120``). Lightning already turns SIGTERM into a flag that its loops check once the
current training step has finished (then they raise ``SIGTERMException``, which used to end
``mmpo fit`` with exit code 0 and nothing saved). ``PreemptionCheckpoint`` builds on that:

- every signal in ``signals`` is routed to Lightning's SIGTERM handling (Lightning handles only
  SIGTERM), so the run stops after the current step, never inside it;
- when the loop stops, ``last.ckpt`` of the last completed step is written through the Trainer
  (``VerifiedCheckpointIO``: atomic, sha256 sidecar, with the data position and every state Lightning
  saves), unless the ``ModelCheckpoint`` wrote it at that very step;
- ``mmpo fit`` then exits with ``128 + signal number`` (SIGTERM: 143, SIGUSR1: 138);
- with ``requeue: true`` under SLURM the job is requeued (``scontrol requeue``, as Lightning's own
  auto-requeue does); the requeued job resumes with ``--ckpt_path last`` or the ``last.ckpt`` path.

A second signal while the checkpoint is written only sets the flag again: the save completes.
Why not Lightning's SLURM auto-requeue as it is: it saves from inside the signal handler, i.e. in the
middle of a step (half an optimizer update, a data position one batch off).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Sequence

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mmpo.training.checkpoint import checksum_status

log = logging.getLogger(__name__)

#: exit status of a run stopped by signal N with its checkpoint saved: 128 + N, what a shell reports for
#: a process that signal ended (SIGTERM -> 143, SIGUSR1 -> 138)
SIGNAL_EXIT_BASE = 128
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")

_received_signal: int | None = None


def received_stop_signal() -> int | None:
    """The signal that stopped the last run in this process (None when none did)."""
    return _received_signal


def preempted_exit_code(signum: int | None) -> int:
    """``mmpo fit``'s exit status after a stop signal: ``128 + signum`` (SIGTERM when unknown)."""
    return SIGNAL_EXIT_BASE + int(signum if signum is not None else signal.SIGTERM)


def _signal_number(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if key in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, key):
        valid = ", ".join(sorted(s.name for s in signal.valid_signals() if isinstance(s, signal.Signals)
                                 and s not in (signal.SIGKILL, signal.SIGSTOP)))
        raise ValueError(f"PreemptionCheckpoint: {name!r} is not a signal a run can catch; use one of {valid}")
    return signal.Signals[key]


def slurm_job_id() -> str | None:
    """The SLURM job to requeue (``<array job>_<task>`` for array jobs), None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and os.environ.get("SLURM_ARRAY_TASK_ID") is not None:
        job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job = os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


class PreemptionCheckpoint(Callback):
    """On a stop signal: finish the current step, save ``last.ckpt``, exit ``128 + signal`` (module doc).

    Args:
        signals: the signals that stop the run this way (names such as ``SIGTERM``, ``SIGUSR1``).
            SIGTERM always stops the run at a step boundary (Lightning); leaving it out only skips the save.
        requeue: under SLURM, requeue the job (``scontrol requeue``) once the checkpoint is saved.
    """

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS, requeue: bool = False) -> None:
        self.signals = tuple(_signal_number(name) for name in signals)
        self.requeue = requeue
        self.saved_path: Path | None = None

    # ------------------------------------------------------------------ signals
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning registers its SIGTERM handler just before the loops start (after on_fit_start);
        # ours go on top. Lightning's teardown puts back the handlers from before the run.
        global _received_signal
        _received_signal = None
        lightning_sigterm = signal.getsignal(signal.SIGTERM)
        for signum in self.signals:
            signal.signal(signum, self._handler(lightning_sigterm))

    def _handler(self, lightning_sigterm: Any) -> Callable[[int, FrameType | None], None]:
        def stop_after_this_step(signum: int, frame: FrameType | None) -> None:
            global _received_signal
            if _received_signal is None:
                _received_signal = signum
                log.warning("received %s: stopping after the current step and saving last.ckpt",
                            signal.Signals(signum).name)
            if callable(lightning_sigterm):  # sets trainer.received_sigterm (and tells other ranks)
                lightning_sigterm(signal.SIGTERM, frame)

        return stop_after_this_step

    # ------------------------------------------------------------------ the save
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        global _received_signal
        if not isinstance(exception, SIGTERMException):
            return
        if _received_signal is None:
            _received_signal = signal.SIGTERM  # Lightning's own handler saw it (no hook of ours ran)
        if signal.Signals(_received_signal) not in self.signals:
            return
        path = self._last_path(trainer)
        if not self._already_saved(trainer, path):
            checkpoint = trainer.checkpoint_callback
            if isinstance(checkpoint, ModelCheckpoint) and path.parent == Path(checkpoint.dirpath or ""):
                # recorded in the checkpoint, so the resumed run's ModelCheckpoint keeps writing last.ckpt
                # (not last-v1.ckpt beside it)
                checkpoint.last_model_path = str(path)
            trainer.save_checkpoint(path)
        self.saved_path = path
        if trainer.is_global_zero:
            log.warning("stopped by %s after step %d; saved %s (resume with --ckpt_path %s)",
                        signal.Signals(_received_signal).name, trainer.global_step, path, path)
            if self.requeue:
                self._requeue()

    @staticmethod
    def _last_path(trainer: Any) -> Path:
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is not None:
            name = checkpoint.CHECKPOINT_NAME_LAST
            if "{" in name:  # a templated last name: use the plain one
                name = ModelCheckpoint.CHECKPOINT_NAME_LAST
            return Path(checkpoint.dirpath) / f"{name}{checkpoint.FILE_EXTENSION}"
        return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    @staticmethod
    def _already_saved(trainer: Any, path: Path) -> bool:
        """ModelCheckpoint wrote ``path`` at this very step (it saves before the loop checks the flag)."""
        checkpoint = trainer.checkpoint_callback
        return (isinstance(checkpoint, ModelCheckpoint) and checkpoint._last_global_step_saved == trainer.global_step
                and os.path.abspath(checkpoint.last_model_path or "") == os.path.abspath(path)
                and path.is_file() and checksum_status(path) == "ok")

    @staticmethod
    def _requeue() -> None:
        job = slurm_job_id()
        if job is None:
            log.warning("requeue: true, but this is not a SLURM job (no SLURM_JOB_ID): not requeued")
            return
        try:
            result = subprocess.run(["scontrol", "requeue", job], check=False).returncode
        except FileNotFoundError:
            result = -1
        if result == 0:
            log.warning("requeued SLURM job %s", job)
        else:
            log.warning("scontrol requeue %s failed (status %s): requeue the job by hand", job, result)
