"""`mmpo demos` smoke run with a tiny budget."""

import json

import h5py

from mmpo.robotics.cli import demos_main


def test_demos_cli_writes_files_and_reports(tmp_path, capsys):
    out = tmp_path / "cli" / "lift.hdf5"
    code = demos_main(
        ["--task", "lift", "--num-demos", "1", "--noise", "0.05", "--out", str(out), "--seed", "3", "--max-steps", "120"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "expert success rate 1.000" in printed
    assert f"demos: {out}" in printed and f"normaliser stats: {out}.stats.json" in printed
    stats = json.loads(printed.strip().splitlines()[-1])
    assert stats["noise"] == 0.05 and stats["num_demos"] == 1
    with h5py.File(out, "r") as handle:
        assert int(handle["data"].attrs["total"]) == stats["total_samples"]
    assert (tmp_path / "cli" / "lift.hdf5.stats.json").exists()


def test_demos_cli_rejects_bad_values(tmp_path, capsys):
    assert demos_main(["--task", "lift", "--num-demos", "0", "--out", str(tmp_path / "x.hdf5")]) == 2
    assert "--num-demos must be >= 1, got 0" in capsys.readouterr().err
    assert demos_main(["--task", "lift", "--num-demos", "1", "--noise", "-1", "--out", str(tmp_path / "x.hdf5")]) == 2
    assert "--noise must be >= 0" in capsys.readouterr().err
