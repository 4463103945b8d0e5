"""bench/bench_tarot_testbed.py: the summary over seeds (means, paired differences against the SFT start, seed-t
intervals) and its table, on hand values."""

from __future__ import annotations

import pytest

from bench_support import load_bench

bench = load_bench("bench_tarot_testbed")


def _policy(attacker: float, utility: float = 1.0) -> dict:
    return {"attacker_accuracy": attacker, "static_attacker_accuracy": attacker - 0.1, "utility_accuracy": utility,
            "privacy": 1.0 - attacker, "utility": 0.99, "tics_per_text": attacker}


def test_summary_and_table_hand_values():
    per_seed = [{"seed": seed, "policies": {"original": _policy(1.0), "sft": _policy(sft), "grpo": _policy(grpo),
                                            "dpo": _policy(dpo, 0.9)}}
                for seed, (sft, grpo, dpo) in enumerate([(0.8, 0.4, 0.5), (0.7, 0.5, 0.3), (0.9, 0.3, 0.4)])]
    summary = bench.summarize(per_seed)
    assert summary["seeds"] == [0, 1, 2]
    assert summary["policies"]["sft"]["attacker_accuracy"]["mean"] == pytest.approx(0.8)
    grpo = summary["vs_sft"]["grpo"]["attacker_accuracy"]
    assert grpo["per_seed"] == pytest.approx([-0.4, -0.2, -0.6]) and grpo["mean"] == pytest.approx(-0.4)
    # seed-t: -0.4 +- t(0.975, 2) * sd / sqrt(3), sd = 0.2, t = 4.3027
    low, high = grpo["seed_t"]
    assert (low, high) == pytest.approx((-0.4 - 4.302653 * 0.2 / 3 ** 0.5, -0.4 + 4.302653 * 0.2 / 3 ** 0.5), abs=1e-5)
    assert summary["vs_sft"]["dpo"]["utility_accuracy"]["mean"] == pytest.approx(-0.1)
    table = bench.table(summary)
    assert "| SFT start | 0.800 [0.552, 1.048] |" in table
    assert "| GRPO - SFT | -0.400 [-0.897, +0.097] |" in table
    assert table.count("\n") == 7  # header, rule, 4 policies, 2 differences
