"""configs/agent/dialtree_tiny.yaml and its flat baseline dialtree_flat_tiny.yaml through the CLI: 2 steps each on
the lock task from the tiny text LM, validation, and a resume from the checkpoint for a third step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from agent_envs_support import agent_fit_args

from mmpo.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "agent"


@pytest.mark.parametrize("config", ["dialtree_tiny.yaml", "dialtree_flat_tiny.yaml"])
def test_dialtree_tiny_trains_two_steps(tmp_path, config):
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
            "--intermediate-size", "64", "--num-layers", "1"]) == 0
    logs = tmp_path / "logs"
    args = agent_fit_args(CONFIGS / config, base, tmp_path, "--model.init_args.sampling.max_new_tokens=8",
                          "--model.init_args.dialtree.max_total_tokens=48")
    assert main(args) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged: dict[str, str] = {}
    for row in csv.DictReader(path.open()):
        logged.update({key: value for key, value in row.items() if value})
    assert {"dialtree/success_rate", "dialtree/format_valid_rate", "dialtree/leaves_per_goal",
            "dialtree/target_queries", "losses/policy", "val/success", "val/format_valid"} <= set(logged)
    assert 2 <= float(logged["dialtree/leaves_per_goal"]) and float(logged["dialtree/target_queries"]) >= 0
    if config == "dialtree_flat_tiny.yaml":  # flat: num_generations dialogues per goal, at most 3 queries each
        assert float(logged["dialtree/leaves_per_goal"]) == 3.0 and float(logged["dialtree/target_queries"]) <= 9
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    # resume from the checkpoint for one more step
    resumed = [a for a in args if not a.startswith("--trainer.max_steps")]
    assert main([*resumed, "--trainer.max_steps=3", f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}"]) == 0
    steps = [row["step"] for path in logs.glob("**/metrics.csv") for row in csv.DictReader(path.open())
             if row.get("dialtree/leaves_per_goal")]
    assert sorted(set(int(step) for step in steps)) == [0, 1, 2]
