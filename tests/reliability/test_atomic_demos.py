"""`mmpo demos` never destroys data: an existing --out is kept unless --overwrite, an interrupted run
leaves the old dataset and stats intact (no partial file at --out), and stats are checked against the
dataset they sit beside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import mmpo.robotics.demos.generate as generate
from mmpo.robotics.bc import ChunkDataModule
from mmpo.robotics.cli import demos_main
from mmpo.robotics.data import ChunkDataset
from mmpo.files import file_sha256

ARGS = ["--task", "lift", "--num-demos", "1", "--noise", "0.05", "--seed", "3", "--max-steps", "120", "--no-progress"]


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    """A real 1-demo Lift dataset and its stats."""
    out = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    assert demos_main([*ARGS, "--out", str(out)]) == 0
    return out


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_stats_record_the_hash_of_the_data_they_describe(demos):
    stats = json.loads(Path(f"{demos}.stats.json").read_text())
    assert stats["data_sha256"] == file_sha256(demos)
    assert sorted(p.name for p in demos.parent.iterdir()) == ["lift.hdf5", "lift.hdf5.stats.json"]


def test_existing_out_is_refused_without_overwrite(demos, tmp_path, capsys):
    out = tmp_path / "lift.hdf5"
    shutil.copy(demos, out)
    shutil.copy(f"{demos}.stats.json", f"{out}.stats.json")
    before = _snapshot(tmp_path)
    assert demos_main([*ARGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} and {out}.stats.json already exist; pass --overwrite" in err
    assert _snapshot(tmp_path) == before
    with pytest.raises(FileExistsError, match="overwrite"):
        generate.generate_demos("lift", 1, out, progress=False)
    assert _snapshot(tmp_path) == before


def test_interrupted_overwrite_keeps_the_old_dataset_and_leaves_no_partial_file(demos, tmp_path, monkeypatch):
    out = tmp_path / "lift.hdf5"
    shutil.copy(demos, out)
    shutil.copy(f"{demos}.stats.json", f"{out}.stats.json")
    before = _snapshot(tmp_path)
    real_episode, calls = generate._episode, []

    def episode_then_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first demo is already written to the new file when this fires
            raise KeyboardInterrupt("simulated interruption")
        return real_episode(*args, **kwargs)

    monkeypatch.setattr(generate, "_episode", episode_then_crash)
    with pytest.raises(KeyboardInterrupt):
        demos_main([*ARGS[:3], "2", *ARGS[4:], "--out", str(out), "--overwrite"])
    assert len(calls) == 2
    assert _snapshot(tmp_path) == before  # old data and stats byte-identical, no partial/temp file beside them
    ChunkDataModule(str(out), batch_size=4).setup("fit")  # and still a consistent pair


def test_overwrite_replaces_both_files_together(demos, tmp_path):
    out = tmp_path / "lift.hdf5"
    shutil.copy(demos, out)
    shutil.copy(f"{demos}.stats.json", f"{out}.stats.json")
    assert demos_main([*ARGS[:-3], "--max-steps", "100", "--no-progress", "--out", str(out), "--overwrite"]) == 0
    assert out.read_bytes() != demos.read_bytes()
    assert json.loads(Path(f"{out}.stats.json").read_text())["data_sha256"] == file_sha256(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lift.hdf5", "lift.hdf5.stats.json"]


def test_stats_beside_other_data_are_rejected_naming_both_files(demos, tmp_path):
    out = tmp_path / "lift.hdf5"
    shutil.copy(demos, out)
    shutil.copy(f"{demos}.stats.json", f"{out}.stats.json")
    with open(out, "ab") as handle:  # the data changed after its stats were written
        handle.write(b"\0")
    stats = f"{out}.stats.json"
    with pytest.raises(ValueError, match=rf"normaliser stats {stats} do not belong to the dataset {out}"):
        ChunkDataModule(str(out), batch_size=4).setup("fit")
    with pytest.raises(ValueError, match="do not belong to the dataset"):
        ChunkDataset(out, horizon=4)
    # an explicitly chosen stats file is the user's decision and is not checked
    ChunkDataset(out, horizon=4, normalizer=stats)
