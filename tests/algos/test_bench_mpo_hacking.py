"""bench/bench_mpo_hacking.py: first/last-window changes read from a metrics.csv, the seed-t summary, the paired
MPO - fixed differences and the table, on hand values."""

from __future__ import annotations

import csv

import pytest

from bench_support import load_bench

bench = load_bench("bench_mpo_hacking")


def test_changes_from_a_metrics_file(tmp_path):
    path = tmp_path / "metrics.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["step", "rewards/judge/mean", "mpo/oracle_mean", "mpo/rubric_iteration"])
        writer.writeheader()
        for step, (proxy, oracle) in enumerate([(1, 0.5), (2, 0.25), (3, 0.0), (5, 0.0)]):
            writer.writerow({"step": step, "rewards/judge/mean": proxy, "mpo/oracle_mean": oracle,
                             "mpo/rubric_iteration": step // 2})
        writer.writerow({"step": 4, "rewards/judge/mean": "", "mpo/oracle_mean": "", "mpo/rubric_iteration": ""})
    got = bench.changes(path, window=2)
    # first two batches: proxy 1.5, oracle 0.375; last two: proxy 4, oracle 0
    assert got == {"batches": 4.0, "proxy_first": 1.5, "proxy_last": 4.0, "proxy_change": 2.5,
                   "oracle_first": 0.375, "oracle_last": 0.0, "oracle_change": -0.375, "rubric_iterations": 1.0}


def _run(proxy_change: float, oracle_change: float) -> dict:
    return {"proxy_first": 1.0, "proxy_last": 1.0 + proxy_change, "proxy_change": proxy_change,
            "oracle_first": 0.5, "oracle_last": 0.5 + oracle_change, "oracle_change": oracle_change}


def test_summary_and_table_hand_values():
    results = {"fixed": {0: _run(3.0, -0.3), 1: _run(4.0, -0.4), 2: _run(2.0, -0.2)},
               "mpo": {0: _run(-1.0, 0.0), 1: _run(-1.0, -0.1), 2: _run(-1.0, 0.2)}}
    summary = bench.summarize(results, [0, 1, 2])
    assert summary["fixed_proxy_change"]["mean"] == pytest.approx(3.0)
    # seed-t: 3 +- t(0.975, 2) * sd / sqrt(3), sd = 1, t = 4.302653
    half = 4.302653 / 3 ** 0.5
    assert summary["fixed_proxy_change"]["ci95"] == pytest.approx([3.0 - half, 3.0 + half], abs=1e-5)
    paired = summary["paired_oracle_mpo_minus_fixed"]
    assert paired["per_seed"] == pytest.approx([0.3, 0.3, 0.4]) and paired["mean"] == pytest.approx(1 / 3)
    assert summary["mpo_proxy_change"]["ci95"] == pytest.approx([-1.0, -1.0])  # no spread
    text = bench.table(summary)
    assert ("| fixed | +3.000 [+0.516, +5.484] | -0.300 [-0.548, -0.052] | 1.000->4.000, 1.000->5.000, 1.000->3.000 |"
            in text)
    assert "paired MPO - fixed, oracle change: +0.333 [+0.190, +0.477] (per seed +0.300, +0.300, +0.400)" in text
