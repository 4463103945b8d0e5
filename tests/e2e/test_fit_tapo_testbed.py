"""The TAPO testbed's configs (configs/llm/tapo_testbed_tiny.yaml, tapo_testbed_grpo_tiny.yaml) train 2 steps each
through `mmpo fit`, after a small weak start and `mmpo tapo-library` on it, as bench/bench_tapo_testbed.py chains
them; both log the all-wrong group share."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from mmpo.algos.tapo_testbed import build_weak_start
from mmpo.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_tapo_testbed_configs_train_two_steps(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    testbed = tmp_path / "runs" / "tapo_testbed"
    build_weak_start(testbed, steps=2, hidden_size=32, log_every=0)
    assert main(["tapo-library", "--model", str(testbed / "weak_start"), "--tasks", "strategy_mix", "--size", "3",
                 "--samples", "2", "--max-depth", "1", "--beam", "1", "--max-new-tokens", "10",
                 "--out", str(testbed / "library.json")]) == 0
    library = json.loads((testbed / "library.json").read_text())
    assert sorted(t["complexity"] for t in library["templates"]) == [4, 5, 6]  # the 3 seed problems: one per family
    for name in ("tapo", "grpo"):
        config = REPO / "configs" / "llm" / f"tapo_testbed{'' if name == 'tapo' else '_grpo'}_tiny.yaml"
        assert main(["fit", "-c", str(config), "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
                     "--data.init_args.batch_size=2", "--data.init_args.train_size=8",
                     "--model.init_args.sampling.num_generations=3", "--model.init_args.sampling.max_new_tokens=10"]) == 0
        assert (testbed / name / "config.json").is_file()  # the HF export
        (metrics,) = (testbed / f"{name}_logs").glob("**/metrics.csv")
        logged = [row for row in csv.DictReader(metrics.open()) if row.get("tapo/all_wrong_group_frac")]
        assert len(logged) == 2
        assert all(float(row["tapo/all_wrong_group_frac"]) in (0.0, 0.5, 1.0) for row in logged)  # of 2 groups
        if name == "tapo":
            assert all(row["tapo/guided_reward_mean"] for row in logged)
