"""bench/bench_multiturn_cost.py: the ratios on hand values, and the scripted environment's episode."""

from __future__ import annotations

import pytest

from bench_support import load_bench


def test_ratio_summary_per_rollout_and_per_token():
    bench = load_bench("bench_multiturn_cost")
    rounds = [{"multi": {"wall_s": 3.0, "cpu_s": 2.0, "generated_tokens": 100},
               "single": {"wall_s": 2.0, "cpu_s": 1.0, "generated_tokens": 50}},
              {"multi": {"wall_s": 2.4, "cpu_s": 1.2, "generated_tokens": 100},
               "single": {"wall_s": 2.0, "cpu_s": 1.0, "generated_tokens": 100}},
              {"multi": {"wall_s": 1.0, "cpu_s": 1.0, "generated_tokens": 100},
               "single": {"wall_s": 1.0, "cpu_s": 1.0, "generated_tokens": 100}}]
    summary = bench.ratio_summary(rounds)
    assert summary["wall_s"]["per_round"] == pytest.approx([1.5, 1.2, 1.0]) and summary["wall_s"]["median"] == 1.2
    assert summary["cpu_s"]["per_round"] == pytest.approx([2.0, 1.2, 1.0])
    # per generated token: round 0 generated twice the tokens on the multi side: (3/100) / (2/50) = 0.75
    assert summary["wall_s_per_token"]["per_round"] == pytest.approx([0.75, 1.2, 1.0])
    assert summary["cpu_s_per_token"]["median"] == pytest.approx(1.0)


def test_scripted_environment_answers_all_turns_but_the_last():
    bench = load_bench("bench_multiturn_cost")
    env = bench.ScriptedToolEnvironment(answers=2)
    assert env.reset({"problem": "What is 2 + 2?"}) == "What is 2 + 2?"
    first, second, third = env.step("a"), env.step("b"), env.step("c")
    assert first.observation == [{"role": "tool", "content": "result 1"}] and not first.done
    assert second.observation == [{"role": "tool", "content": "result 2"}] and not second.done
    assert third.done and third.observation == []
