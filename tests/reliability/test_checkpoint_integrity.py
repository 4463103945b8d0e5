"""Damaged checkpoints never load silently (issue 11, item 3).

A real tiny Lightning checkpoint (BoringModel + Adam, so the optimizer state holds tensors) is
saved through ``VerifiedCheckpointIO``; bytes inside the optimizer state are then overwritten,
the file is truncated, or its sidecar is missing, and resuming must refuse (naming the file and
the newest good checkpoint) or warn.
"""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from mmpo.training.checkpoint import (
    CorruptCheckpointError,
    VerifiedCheckpointIO,
    atomic_torch_save,
    checksum_status,
    previous_path,
    select_resume_checkpoint,
    sidecar_path,
)


class AdamBoring(BoringModel):
    """BoringModel with Adam: exp_avg / exp_avg_sq give the checkpoint a real optimizer state."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _trainer(root: Path, max_steps: int, **kwargs) -> Trainer:
    checkpoint = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_last=True, save_top_k=-1)
    return Trainer(default_root_dir=root, max_steps=max_steps, limit_val_batches=0, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint],
                   plugins=[VerifiedCheckpointIO()], accelerator="cpu", **kwargs)


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    """Four steps, checkpoints at steps 2 and 4 and last.ckpt (== step 4)."""
    _trainer(tmp_path, 4).fit(AdamBoring())
    return tmp_path


def _overwrite_optimizer_bytes(path: Path) -> None:
    """Write NaN over the first values of exp_avg, found by its bytes in the file."""
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"][0]["exp_avg"]
    raw = path.read_bytes()
    needle = state.numpy().tobytes()
    offset = raw.index(needle)
    nan = struct.pack("<f", float("nan")) * 4
    path.write_bytes(raw[:offset] + nan + raw[offset + len(nan):])


def test_save_writes_sidecars_and_keeps_previous(run_dir):
    ckpts = run_dir / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=2.ckpt.sha256", "epoch=0-step=4.ckpt",
                     "epoch=0-step=4.ckpt.sha256", "last.ckpt", "last.ckpt.sha256",
                     "last.prev.ckpt", "last.prev.ckpt.sha256"]
    for name in ("last.ckpt", "last.prev.ckpt", "epoch=0-step=2.ckpt"):
        assert checksum_status(ckpts / name) == "ok"
    # the previous last.ckpt is the step-2 state, kept when step 4 replaced it
    assert torch.load(ckpts / "last.prev.ckpt", weights_only=True)["global_step"] == 2
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 4


def test_overwritten_optimizer_bytes_are_refused_naming_file_and_fallback(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    _overwrite_optimizer_bytes(last)
    # Without the guard this loads: the NaN sits in Adam's state and would poison the next step.
    assert torch.isnan(torch.load(last, weights_only=True)["optimizer_states"][0]["state"][0]["exp_avg"]).any()
    with pytest.raises(CorruptCheckpointError) as raised:
        _trainer(run_dir / "resume", 6).fit(AdamBoring(), ckpt_path=str(last))
    message = str(raised.value)
    assert str(last) in message and "sha256 does not match" in message
    # newest good one: step-4 top-k file (written just before last.ckpt)
    assert f"newest good checkpoint is {run_dir / 'checkpoints' / 'epoch=0-step=4.ckpt'}" in message


def test_non_finite_state_without_sidecar_is_refused(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    _overwrite_optimizer_bytes(last)
    sidecar_path(last).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"optimizer_states\[0\]\.state\.0\.exp_avg holds NaN or inf"):
        VerifiedCheckpointIO().load_checkpoint(last)


def test_truncated_checkpoint_is_refused(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    raw = last.read_bytes()
    last.write_bytes(raw[: len(raw) // 2])
    sidecar_path(last).unlink()  # even without a checksum, an unreadable file is named as damaged
    with pytest.raises(CorruptCheckpointError, match="cannot be read") as raised:
        VerifiedCheckpointIO().load_checkpoint(last)
    assert str(last) in str(raised.value)


def test_missing_sidecar_loads_with_warning(run_dir):
    last = run_dir / "checkpoints" / "last.ckpt"
    sidecar_path(last).unlink()
    with pytest.warns(UserWarning, match="has no .sha256 checksum"):
        checkpoint = VerifiedCheckpointIO().load_checkpoint(last)
    assert checkpoint["global_step"] == 4


def test_select_resume_checkpoint_falls_back_to_previous(tmp_path):
    # save_top_k=0 (the quickstart's setting): last.prev.ckpt is the only fallback
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last=True, save_top_k=0)
    Trainer(default_root_dir=tmp_path, max_steps=4, limit_val_batches=0, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[checkpoint], plugins=[VerifiedCheckpointIO()]).fit(AdamBoring())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert select_resume_checkpoint(last) == last
    last.write_bytes(last.read_bytes()[:100])
    with pytest.warns(UserWarning) as caught:
        chosen = select_resume_checkpoint(last)
    assert chosen == previous_path(last)
    assert str(last) in str(caught[0].message) and str(previous_path(last)) in str(caught[0].message)
    previous_path(last).write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError, match="No good checkpoint was found"):
        select_resume_checkpoint(last)


def test_atomic_save_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def failing_save(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_torch_save({"state_dict": {"w": torch.zeros(3)}}, path)
    assert path.read_bytes() == before and checksum_status(path) == "ok"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.sha256"]


def test_remove_checkpoint_removes_sidecar_and_previous(tmp_path):
    io = VerifiedCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"state_dict": {}}, path)
    io.save_checkpoint({"state_dict": {}}, path)
    assert previous_path(path).is_file()
    io.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


def test_symlinked_last_is_verified_through_its_target(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last="link",
                                 save_top_k=-1)
    Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[checkpoint], plugins=[VerifiedCheckpointIO()]).fit(AdamBoring())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and checksum_status(last) == "ok"
    sidecar_path(last).write_text("0" * 64 + "  last.ckpt\n")  # stale sidecar of a file the link replaced
    assert checksum_status(last) == "ok"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "missing sidecar" warning for the link
        assert VerifiedCheckpointIO().load_checkpoint(last)["global_step"] == 2


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_mmpo_cli_falls_back_from_a_damaged_ckpt_path_and_refuses_with_nothing_good(run_dir, damage, capsys):
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    from mmpo.training.cli_support import MMPOLightningCLI

    last = run_dir / "checkpoints" / "last.ckpt"
    if damage == "overwrite":
        _overwrite_optimizer_bytes(last)
    else:
        last.write_bytes(last.read_bytes()[:1000])
    args = ["fit", f"--ckpt_path={last}", f"--trainer.default_root_dir={run_dir / 'resume'}", "--trainer.logger=false",
            "--trainer.max_steps=6", "--trainer.enable_progress_bar=false"]
    # the newest verifiable checkpoint beside it (the step-4 top-k file, written just before last.ckpt) is used
    cli = MMPOLightningCLI(AdamBoring, BoringDataModule, args=args)
    good = run_dir / "checkpoints" / "epoch=0-step=4.ckpt"
    assert cli.trainer.ckpt_path == str(good) and cli.trainer.global_step == 6
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "cannot be used" in line]
    assert line.startswith(f"mmpo fit: checkpoint {last} cannot be used (") and line.endswith(f"beside it, {good}")

    for other in run_dir.joinpath("checkpoints").glob("*.ckpt"):
        if other != last:
            other.unlink()
    with pytest.raises(CorruptCheckpointError, match="No good checkpoint was found") as raised:
        MMPOLightningCLI(AdamBoring, BoringDataModule, args=args)
    assert str(last) in str(raised.value)
