"""bench/text_quickstart_seeds.py: the per-seed rows and the pooled GRPO - SFT contrasts, on hand-made runs."""

from __future__ import annotations

import json

import pytest
from bench_support import load_bench

seeds = load_bench("text_quickstart_seeds")

# (question colour, correct after SFT, correct after GRPO) per item, two seeds
RUNS = {0: [("red", 0, 1), ("purple", 1, 1), ("orange", 1, 0), ("blue", 0, 1)],
        1: [("red", 0, 0), ("purple", 0, 1), ("green", 0, 1), ("orange", 1, 1)]}


def _write_run(root, seed, items):
    run = root / f"seed{seed}"
    for stage, column in (("after_sft", 1), ("after_grpo", 2)):
        (run / "eval" / stage / "predictions").mkdir(parents=True)
        lines = [json.dumps({"id": f"inventory-test-s{seed}-{i}", "prompt": f"How many {item[0]} coins does Ana have? "
                             "Ana has 3 red coins and 4 purple coins.", "completions": ["x"], "correct": [bool(item[column])]})
                 for i, item in enumerate(items)]
        (run / "eval" / stage / "predictions" / "synth_inventory.jsonl").write_text("\n".join(lines) + "\n")
    sft, grpo = (sum(item[c] for item in items) / len(items) for c in (1, 2))
    (run / "quickstart.json").write_text(json.dumps({
        "seed": seed, "accuracy": {"after SFT": {"mean": sft}, "after GRPO": {"mean": grpo}},
        "grpo_vs_sft": {"gain": grpo - sft, "interval": [-0.1, 0.6]},
        "abstained": {"after SFT": 0.5, "after GRPO": 0.0}, "reward": {"first": 0.2, "last": 0.4}}))


@pytest.fixture
def root(tmp_path):
    for seed, items in RUNS.items():
        _write_run(tmp_path, seed, items)
    (tmp_path / "seed9").mkdir()  # unfinished: no quickstart.json, left out
    return tmp_path


def test_pooled_contrasts_on_hand_values(root):
    everything = seeds.pooled(root)
    # seed 0: (+1 + 0 - 1 + 1) / 4 = 0.25; seed 1: (0 + 1 + 1 + 0) / 4 = 0.5
    assert everything["per_seed"] == [0.25, 0.5] and everything["estimate"] == 0.375 and everything["items"] == 8
    # seed-t: 0.375 +- t(0.975, 1) * sd / sqrt(2), sd = 0.25 / sqrt(2), t = 12.7062
    assert everything["seed_t"] == pytest.approx((0.375 - 12.7062 * 0.125, 0.375 + 12.7062 * 0.125), abs=1e-3)
    control = seeds.pooled(root, lambda run: seeds.asked_in(run, ("purple", "orange")))
    # seed 0: purple 1 -> 1, orange 1 -> 0: -0.5; seed 1: purple 0 -> 1, orange 1 -> 1: +0.5
    assert control["per_seed"] == [-0.5, 0.5] and control["estimate"] == 0.0 and control["items"] == 4


def test_report_rows_and_errors(root, tmp_path_factory, capsys):
    text = seeds.report(root)
    assert "| 0 | 0.500 | 0.750 | +0.250 | [-0.100, +0.600] | 50% -> 0% | 1.000 -> 0.500 (2) | 0.200 -> 0.400 |" in text
    assert "| 1 | 0.250 | 0.750 | +0.500 |" in text and "| 9 |" not in text
    assert "all items (8 paired items): +0.3750" in text and "purple/orange questions (4 paired items): +0.0000" in text
    assert seeds.main([str(tmp_path_factory.mktemp("empty"))]) == 2
    assert "no finished quickstart run" in capsys.readouterr().err
