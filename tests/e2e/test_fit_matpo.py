"""configs/agent/matpo_tiny.yaml through the CLI: 2 MATPO steps from the tiny text LM (planner with the subagent
tool, workers with the calculator), validation, the rollout log, and a resume from the checkpoint for a third step."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from agent_envs_support import agent_fit_args

from mmpo.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "agent"


def test_matpo_tiny_trains_two_steps(tmp_path):
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
            "--intermediate-size", "64", "--num-layers", "1"]) == 0
    logs = tmp_path / "logs"
    args = agent_fit_args(CONFIGS / "matpo_tiny.yaml", base, tmp_path, "--model.init_args.sampling.num_generations=2",
                          "--model.init_args.sampling.max_new_tokens=8", "--model.init_args.agent.max_total_tokens=40",
                          "--model.init_args.matpo.worker_max_total_tokens=24")
    assert main(args) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged: dict[str, str] = {}
    for row in csv.DictReader(path.open()):
        logged.update({key: value for key, value in row.items() if value})
    assert {"matpo/workers_per_planner", "matpo/worker_tokens_mean", "losses/policy", "val/accuracy"} <= set(logged)
    records = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 2 * 2 * 2 and {record["step"] for record in records} == {0, 1}
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    # resume from the checkpoint for one more step
    resumed = [a for a in args if not a.startswith("--trainer.max_steps")]
    assert main([*resumed, "--trainer.max_steps=3", f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}"]) == 0
    steps = [row["step"] for path in logs.glob("**/metrics.csv") for row in csv.DictReader(path.open())
             if row.get("matpo/workers_per_planner")]
    assert sorted(set(int(step) for step in steps)) == [0, 1, 2]
