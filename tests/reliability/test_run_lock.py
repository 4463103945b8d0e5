"""One run per checkpoint directory; ``last.ckpt`` is always the newest run's (issue 11, item 8)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from mmpo.training.run_lock import LOCK_NAME, DirectoryLock, RunDirectoryLock, RunDirectoryLockedError

HOLD_LOCK = """
import sys, time
from mmpo.training.run_lock import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def _fit(root: Path, ckpt_dir: Path, max_steps: int = 2, ckpt_path: str | None = None) -> Trainer:
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True, save_top_k=1)
    trainer = Trainer(default_root_dir=root, max_steps=max_steps, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      callbacks=[checkpoint, RunDirectoryLock()])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture()
def holder(tmp_path):
    """Another process holding the lock on tmp_path/ckpt, killed (-9) at the end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                               env=env, text=True)
    assert process.stdout.readline().strip() == "locked"
    yield process
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait()


def test_second_run_on_a_locked_directory_fails_naming_the_holder(tmp_path, holder):
    with pytest.raises(RunDirectoryLockedError) as raised:
        _fit(tmp_path / "root", tmp_path / "ckpt")
    message = str(raised.value)
    assert f"pid {holder.pid}" in message and "DirectoryLock" in message  # its live command line
    assert not list((tmp_path / "ckpt").glob("*.ckpt")), "the refused run wrote checkpoints"
    assert (tmp_path / "ckpt" / LOCK_NAME).is_file(), "the refused run removed the holder's lock"

    # kill -9 leaves the lock file behind; the kernel dropped the flock, so the next run takes it over
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    _fit(tmp_path / "root", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists(), "lock not released at the end of fit"


def test_lock_is_released_when_fit_raises(tmp_path):
    class Failing(BoringModel):
        def training_step(self, batch, batch_idx):
            raise ValueError("boom")

    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt"), RunDirectoryLock()])
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(Failing())
    with DirectoryLock(tmp_path / "ckpt"):  # free again
        pass


def test_sequential_rerun_writes_last_ckpt_and_keeps_the_earlier_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, max_steps=2)
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 2
    with pytest.warns(UserWarning, match="written by an earlier run; moved it to"):
        _fit(tmp_path, ckpt, max_steps=3)
    assert not (ckpt / "last-v1.ckpt").exists()
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 3  # the newest run's
    (earlier,) = ckpt.glob("earlier-*")
    assert torch.load(earlier / "last.ckpt", weights_only=True)["global_step"] == 2  # nothing lost


def test_resume_from_last_keeps_writing_last(tmp_path):
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, ckpt, max_steps=2)
    _fit(tmp_path, ckpt, max_steps=4, ckpt_path=str(ckpt / "last.ckpt"))
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 4
    assert not list(ckpt.glob("earlier-*")) and not (ckpt / "last-v1.ckpt").exists()


def test_mmpo_cli_trainers_carry_the_lock_and_verified_checkpoints(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    from mmpo.training.checkpoint import VerifiedCheckpointIO
    from mmpo.training.cli_support import MMPOLightningCLI

    cli = MMPOLightningCLI(BoringModel, BoringDataModule, run=False,
                           args=[f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy.checkpoint_io, VerifiedCheckpointIO)
    assert sum(isinstance(cb, RunDirectoryLock) for cb in cli.trainer.callbacks) == 1
