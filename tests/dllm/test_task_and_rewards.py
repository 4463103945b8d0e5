"""Synthetic arithmetic task and the correctness reward."""

from __future__ import annotations

import random

import pytest

from mmpo.dllm.rewards import correctness_rewards, correctness_rewards_with_deadline, extract_answer, is_correct
from mmpo.dllm.task import ArithmeticTaskConfig, make_problem, make_train_and_test, solve


def test_problems_are_consistent_with_their_traces():
    config = ArithmeticTaskConfig(num_ops=3, max_operand=9, max_value=99)
    rng = random.Random(0)
    for _ in range(200):
        row = make_problem(rng, config)
        assert solve(row["problem"]) == int(row["answer"])
        lines = row["trace"].split("\n")
        assert len(lines) == 4 and lines[-1] == f"A:{row['answer']}"
        for line in lines[:-1]:
            left, result = line.split("=")
            assert solve(left) == int(result) and 0 <= int(result) <= 99
    # Hand example: 7+5*2-3 evaluated left to right = ((7+5)*2)-3 = 21.
    assert solve("7+5*2-3") == 21


def test_train_and_test_are_disjoint_and_deterministic():
    train, test = make_train_and_test(ArithmeticTaskConfig(), 500, 50, seed=0)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert make_train_and_test(ArithmeticTaskConfig(), 500, 50, seed=0)[1] == test
    assert len({r["id"] for r in train + test}) == 550


def test_answer_extraction_and_correctness():
    assert extract_answer("7+5=12\n12*2=24\nA:24") == "24"
    assert extract_answer("A:3\nA:5") == "5"  # the last answer counts
    assert extract_answer("so \\boxed{1/2}") == "1/2"
    assert extract_answer("no answer") is None
    assert is_correct("A:021", "21")
    assert not is_correct("A:20", "21")
    assert is_correct("\\boxed{0.5}", "1/2")  # math-verify fallback
    assert correctness_rewards(["A:1", "A:2", "junk"], ["1", "1", "1"], correct=3.0) == [3.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="completions"):
        correctness_rewards(["A:1"], ["1", "2"])


def test_huge_integer_answers_are_compared_without_int_conversion():
    # int() refuses strings over 4300 digits: that used to raise out of the reward and kill the run.
    assert is_correct("A:" + "1" * 5000, "1" * 5000)
    assert not is_correct("A:" + "1" * 5000, "1" * 4999)
    assert is_correct("A:-0", "0") and is_correct("A:-007", "-7")


@pytest.mark.timeout(60)
def test_scoring_with_a_deadline_runs_in_the_worker_and_survives_a_slow_answer():
    scores, metrics = correctness_rewards_with_deadline(
        ["A:3", "A:0003", "junk", "\\boxed{0.5}"], ["3", "3", "3", "1/2"], correct=3.0, timeout_s=30.0)
    assert scores == [3.0, 3.0, 0.0, 3.0]
    assert metrics["rewards/correct/errors"] == 0.0 and metrics["rewards/correct/verify_errors"] == 0.0
    restarts = metrics["perf/reward_worker_restarts"]
    # math-verify needs its full 5 s timeout on this one: the 1 s deadline kills the worker.
    scores, metrics = correctness_rewards_with_deadline(["\\boxed{10^(10^10)}", "A:3"], ["3", "3"], timeout_s=1.0)
    assert scores == [0.0, 0.0]
    assert metrics["rewards/correct/errors"] == 1.0 and metrics["rewards/correct/timeouts"] == 1.0
    assert metrics["perf/reward_worker_restarts"] == restarts + 1


def test_math_verify_failures_are_counted(monkeypatch):
    import math_verify

    def broken_parse(*args, **kwargs):
        raise RuntimeError("parser crashed")

    monkeypatch.setattr(math_verify, "parse", broken_parse)
    scores, metrics = correctness_rewards_with_deadline(["\\boxed{0.5}", "A:3", "\\boxed{x}"], ["1/2", "3", "2"],
                                                        timeout_s=None)
    assert scores == [0.0, 1.0, 0.0]
    assert metrics["rewards/correct/verify_errors"] == 2.0 and metrics["rewards/correct/errors"] == 0.0


def test_bad_task_settings_fail_clearly():
    with pytest.raises(ValueError, match="num_ops"):
        ArithmeticTaskConfig(num_ops=0)


def test_derivation_format_reward_hand_computed():
    from mmpo.dllm.rewards import derivation_format_reward, format_rewards

    assert derivation_format_reward("7+5=12\n12*2=24\nA:24") == 0.75  # all three parts
    assert derivation_format_reward("7+5=12\nfoo\nA:24\n") == 0.5 + 0.25 * 1 / 2  # one of two steps well formed
    assert derivation_format_reward("A:24\n7+5=12") == 0.25 + 0.25  # answer not last
    assert derivation_format_reward("A:3\nA:4") == 0.0  # two answers: no answer credit, no step lines
    assert derivation_format_reward("7+5=12") == 0.25  # steps only
    assert derivation_format_reward("") == 0.0
    assert format_rewards(["A:1", ""], "derivation") == [0.5, 0.0]


def test_xmlcount_format_reward_matches_igpo_count_xml():
    from mmpo.dllm.rewards import format_rewards, xmlcount_format_reward

    full = "<reasoning>\nx\n</reasoning>\n<answer>\n\\boxed{3}\n</answer>"
    assert xmlcount_format_reward(full) == 0.125 * 4 + 0.25
    assert xmlcount_format_reward("<answer>\n</answer></answer>") == 0.125  # "</answer>" twice earns nothing
    assert xmlcount_format_reward("no tags, \\boxed{2}") == 0.25
    with pytest.raises(ValueError, match="valid"):
        format_rewards(["x"], "strict")
