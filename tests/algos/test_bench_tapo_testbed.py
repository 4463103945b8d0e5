"""bench/bench_tapo_testbed.py: the fifths of a curve, the per-step values read from metrics.csv, and the summary's
paired differences and all-wrong shares, on hand values."""

from __future__ import annotations

import pytest
from bench_support import load_bench

bench = load_bench("bench_tapo_testbed")


def test_fifths_and_logged(tmp_path):
    assert bench.fifth([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5], last=False) == 0.5  # k = 2
    assert bench.fifth([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5], last=True) == 0.5
    assert bench.fifth([0.2, 0.4], last=True) == 0.4  # k = 1
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,tapo/all_wrong_group_frac,lr\n0,0.75,\n0,,1e-4\n1,0.5,\n")
    assert bench.logged(metrics, "tapo/all_wrong_group_frac") == [0.75, 0.5]
    assert bench.all_wrong_fractions(metrics) == [0.75, 0.5]


def test_summary_by_hand():
    start = {"library": {"templates": [{"complexity": 4, "actions": ["SA"], "value": 0.5, "count": 2}]},
             "unguided": {"greedy": [0.0, 0.0, 0.0], "sampled": [0.0, 0.25, 0.5]},
             "guided": {"greedy": [1.0, 0.0, 0.0], "sampled": [0.5, 0.5, 0.5]}}

    def result(algo, seed, greedy, all_wrong):
        return {"algo": algo, "seed": seed, "greedy": greedy, "sampled": greedy, "family": [1, 2, 3],
                "all_wrong": all_wrong}

    runs = {"grpo": [result("grpo", 0, [0.0, 0.0, 0.0], [1.0] * 5), result("grpo", 1, [1.0, 0.0, 0.0], [1.0] * 5)],
            "tapo": [result("tapo", 0, [1.0, 1.0, 1.0], [0.5] * 5),
                     result("tapo", 1, [1.0, 0.0, 1.0], [1.0] * 4 + [0.0])]}
    summary = bench.summarize(start, runs)
    assert summary["start"]["unguided"] == {"greedy": 0.0, "sampled": 0.25}
    assert summary["library"] == [(4, ["SA"], 0.5, 2)]
    greedy = summary["greedy"]
    assert greedy["per_seed"] == {"grpo": [0.0, pytest.approx(1 / 3)], "tapo": [1.0, pytest.approx(2 / 3)]}
    # paired by item: seed 0 (1 + 1 + 1) / 3, seed 1 (0 + 0 + 1) / 3
    assert greedy["tapo_minus_grpo"]["per_seed"] == [1.0, pytest.approx(1 / 3)]
    assert greedy["tapo_minus_grpo"]["estimate"] == pytest.approx(2 / 3)
    assert greedy["grpo_minus_start"]["estimate"] == pytest.approx(1 / 6)
    assert greedy["by_family"] == {"grpo": {1: 0.5, 2: 0.0, 3: 0.0}, "tapo": {1: 1.0, 2: 0.5, 3: 1.0}}
    aw = summary["all_wrong"]
    assert aw["grpo"]["all"] == [1.0, 1.0] and aw["tapo"]["all"] == [0.5, 0.8]
    assert aw["tapo"]["last"] == [0.5, 0.0] and aw["tapo_minus_grpo_last"]["per_seed"] == [-0.5, -1.0]
    assert aw["tapo_minus_grpo_all"]["estimate"] == pytest.approx(-0.35)
