"""Quickstart resume keeps every metric, ``--fresh`` starts fresh, a damaged last.ckpt falls back
(issue 11, item 6). Uses the ``--tiny`` budget and the stage functions directly."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from mmpo.algos.grpo import GRPOModule
from mmpo.eval.plots import read_csv_metrics
from mmpo.quickstart import QuickstartConfig, build_model, main, metrics_files, run_grpo
from mmpo.training.checkpoint import checksum_status

CONFIG = replace(QuickstartConfig.tiny(), grpo_steps=4)  # a checkpoint every step
CURVE = "rewards/total/mean"


@pytest.fixture(scope="module")
def model_init(tmp_path_factory):
    return build_model(CONFIG, tmp_path_factory.mktemp("qs"), seed=0)


@pytest.fixture(scope="module")
def straight_run(model_init, tmp_path_factory):
    """GRPO stage run uninterrupted for 4 steps."""
    stage_dir = tmp_path_factory.mktemp("straight") / "grpo"
    run_grpo(model_init, CONFIG, stage_dir, seed=0, progress=False)
    return stage_dir


def test_read_csv_metrics_joins_resumed_versions(tmp_path):
    first, second = tmp_path / "v0.csv", tmp_path / "v1.csv"
    first.write_text("epoch,loss,step\n0,1.0,0\n0,2.0,1\n0,3.0,2\n0,9.0,3\n")  # step 3 was redone after the crash
    second.write_text("epoch,loss,step\n0,4.0,3\n0,5.0,4\n")
    assert read_csv_metrics([first, second])["loss"] == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)]


def test_metrics_before_a_crash_stay_in_the_curve(model_init, straight_run, tmp_path, monkeypatch):
    expected = read_csv_metrics(metrics_files(straight_run / "logs"))[CURVE]
    assert [step for step, _ in expected] == [0, 1, 2, 3]

    stage_dir = tmp_path / "grpo"
    original = GRPOModule.training_step

    def crash_at_step_2(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("simulated crash")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(GRPOModule, "training_step", crash_at_step_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_grpo(model_init, CONFIG, stage_dir, seed=0, progress=False)
    monkeypatch.setattr(GRPOModule, "training_step", original)
    run_grpo(model_init, CONFIG, stage_dir, seed=0, progress=False)  # resumes from last.ckpt (step 2)

    files = metrics_files(stage_dir / "logs")
    assert [path.parent.name for path in files] == ["version_0", "version_1"]
    assert read_csv_metrics(files[0])[CURVE] == expected[:2]  # the pre-crash rows were not overwritten
    assert read_csv_metrics(files)[CURVE] == expected  # resume is exact, so the joined curve is the straight one


def test_damaged_last_checkpoint_falls_back_to_the_previous_one(model_init, straight_run, tmp_path):
    stage_dir = tmp_path / "grpo"
    shutil.copytree(straight_run, stage_dir)
    last = stage_dir / "checkpoints" / "last.ckpt"
    previous = stage_dir / "checkpoints" / "last.prev.ckpt"
    assert torch.load(previous, weights_only=True)["global_step"] == 3
    last.write_bytes(last.read_bytes()[:1000])  # truncated, as by a full disk

    with pytest.warns(UserWarning) as caught:
        run_grpo(model_init, CONFIG, stage_dir, seed=0, progress=False)
    damaged = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    assert damaged and str(last) in damaged[0] and str(previous) in damaged[0]
    # the last step was redone from step 3 and written as a good last.ckpt
    assert torch.load(last, weights_only=True)["global_step"] == 4 and checksum_status(last) == "ok"


def test_fresh_moves_the_old_output_aside(tmp_path, capsys):
    out = tmp_path / "qs"
    # an earlier, interrupted run: a user file and a truncated SFT checkpoint
    (out / "sft" / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sft" / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")

    assert main(["--tiny", "--out", str(out), "--no-progress", "--fresh"]) == 0
    printed = capsys.readouterr().out
    (old,) = tmp_path.glob("qs.old-*")
    assert f"moved the earlier {out} to {old}" in printed
    assert "resuming" not in printed
    assert (old / "notes.txt").read_text() == "mine"  # nothing deleted
    assert (old / "sft" / "checkpoints" / "last.ckpt").read_bytes() == b"PK\x03\x04 truncated"
    assert not (out / "notes.txt").exists() and (out / "quickstart.json").is_file()
    assert [path.parent.name for path in metrics_files(out / "grpo" / "logs")] == ["version_0"]
