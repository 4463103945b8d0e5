"""The TAROT testbed's configs (configs/llm/tarot_testbed_{sft,grpo,dpo}.yaml) train 2 steps each through
`mmpo fit` on a small testbed built in the working directory, as bench/bench_tarot_testbed.py chains them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.rewards.models import MODEL_REWARDS
from mmpo.rewards.tarot import dpo_pairs, write_dpo_pairs
from mmpo.rewards.tarot_testbed import build_testbed, encoders, read_jsonl, rewrite

REPO = Path(__file__).resolve().parents[2]


def _fit(name: str, tmp_path: Path, *extra: str) -> None:
    assert main(["fit", "-c", str(REPO / "configs" / "llm" / f"tarot_testbed_{name}.yaml"), "--trainer.max_steps=2",
                 "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=2", *extra]) == 0
    assert (tmp_path / "runs" / "tarot_testbed" / name / "config.json").is_file()  # the HF export


def test_tarot_testbed_configs_train_two_steps(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    testbed = tmp_path / "runs" / "tarot_testbed"
    build_testbed(testbed, seed=0, num_sft=64, num_rl=8, num_attack=16, num_heldout=8, encoder_steps=5,
                  policy_hidden=32)
    _fit("sft", tmp_path)
    MODEL_REWARDS.clear()
    try:
        _fit("grpo", tmp_path, "--model.init_args.sampling.num_generations=2",
             "--model.init_args.sampling.max_new_tokens=6")
    finally:
        MODEL_REWARDS.clear()
    (metrics,) = (testbed / "grpo_logs").glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics.open()) if row.get("rewards/tarot/mean")]
    assert len(logged) == 2
    for row in logged:  # the reward is its two parts' sum (means over the same completions)
        assert float(row["rewards/tarot/mean"]) == pytest.approx(
            float(row["rewards/tarot/privacy"]) + float(row["rewards/tarot/utility"]), abs=1e-4)

    sources = [row["problem"] for row in read_jsonl(testbed / "rl.jsonl")]
    samples = rewrite(testbed / "sft", sources, num_samples=2, temperature=1.0, max_new_tokens=8)
    style, semantic = encoders(testbed)
    pairs = dpo_pairs(sources, [s[0] for s in samples], [s[1] for s in samples], style=style, semantic=semantic,
                      privacy_margin=-1.0, utility_tolerance=2.0)  # keep every untied pair: the run needs rows
    assert pairs
    write_dpo_pairs(str(testbed / "dpo_pairs.jsonl"), pairs)
    _fit("dpo", tmp_path)

