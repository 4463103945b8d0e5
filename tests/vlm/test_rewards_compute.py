"""compute_rewards: weighted sum, metrics, and survival of raising / hanging / malformed rewards."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from mmpo.rewards import DEFAULT_REWARD_WEIGHTS, REWARDS, compute_rewards, register_reward

ROWS = [{"answer": "3", "steps": [], "images": []}, {"answer": "left", "steps": [], "images": []}]
COMPLETIONS = [
    "<think>x</think><answer>3</answer>",  # accuracy 1, format 1
    "the answer is \\boxed{right}",  # accuracy 0, format 0
]


@pytest.fixture
def temporary_reward():
    added = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)

    yield add
    for name in added:
        REWARDS.pop(name)


def test_default_weights_and_hand_computed_total():
    assert DEFAULT_REWARD_WEIGHTS == {"accuracy": 0.9, "format": 0.1}
    total, per_fn, metrics = compute_rewards(None, COMPLETIONS, ROWS)
    assert per_fn["accuracy"].tolist() == [1.0, 0.0]
    assert per_fn["format"].tolist() == [1.0, 0.0]
    # 0.9 * 1 + 0.1 * 1 = 1.0 ; 0.9 * 0 + 0.1 * 0 = 0.0
    assert torch.allclose(total, torch.tensor([1.0, 0.0]))
    assert metrics["rewards/accuracy/mean"] == 0.5 and metrics["rewards/format/errors"] == 0.0
    assert metrics["rewards/total/mean"] == pytest.approx(0.5)


def test_custom_weights():
    completions = ["<think>x</think><answer>4</answer>", "<answer>left</answer>"]
    total, _, _ = compute_rewards({"accuracy": 2.0, "format": 0.5}, completions, ROWS)
    # row 0: 2 * 0 + 0.5 * 1 = 0.5 ; row 1: 2 * 1 + 0.5 * 0 = 2.0
    assert total.tolist() == [0.5, 2.0]


def test_raising_reward_gives_zeros_a_warning_and_an_error_count(temporary_reward, caplog):
    def broken(completions, rows):
        raise RuntimeError("boom")

    temporary_reward("unit_broken", broken)
    with caplog.at_level(logging.WARNING):
        total, per_fn, metrics = compute_rewards({"accuracy": 1.0, "unit_broken": 1.0}, COMPLETIONS, ROWS)
    assert per_fn["unit_broken"].tolist() == [0.0, 0.0]
    assert total.tolist() == [1.0, 0.0]  # accuracy still counts
    assert metrics["rewards/unit_broken/errors"] == 1.0 and metrics["rewards/accuracy/errors"] == 0.0
    assert any("unit_broken" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)


def test_unpicklable_hanging_reward_times_out_on_a_thread(temporary_reward, caplog):
    # A closure cannot go to the reward worker process; it runs on a daemon thread, whose deadline
    # stops the waiting only (tests/reliability/test_reward_deadlines.py covers the worker).
    release = threading.Event()

    def hangs(completions, rows):
        release.wait(30)
        return torch.ones(len(completions))

    temporary_reward("unit_hangs", hangs)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            total, per_fn, metrics = compute_rewards({"format": 1.0, "unit_hangs": 1.0}, COMPLETIONS, ROWS,
                                                     timeout_s=0.5)
        elapsed = time.monotonic() - start
        assert elapsed < 5.0
        assert per_fn["unit_hangs"].tolist() == [0.0, 0.0]
        assert total.tolist() == [1.0, 0.0]
        assert metrics["rewards/unit_hangs/errors"] == 1.0
        assert any("did not finish within 0.5 s" in r.getMessage() for r in caplog.records)
        assert any("deadline cannot stop a hang" in r.getMessage() for r in caplog.records)
        # While the first call is still stuck, the next one fails at once without a new thread.
        start = time.monotonic()
        _, per_fn, metrics = compute_rewards({"unit_hangs": 1.0}, COMPLETIONS, ROWS, timeout_s=0.5)
        assert time.monotonic() - start < 0.4
        assert metrics["rewards/unit_hangs/errors"] == 1.0
    finally:
        release.set()
    # Once the stuck call has finished, the reward works again.
    from mmpo.rewards import compute as compute_module

    compute_module._HUNG_THREADS["unit_hangs"].join(5)
    _, per_fn, metrics = compute_rewards({"unit_hangs": 1.0}, COMPLETIONS, ROWS, timeout_s=5)
    assert per_fn["unit_hangs"].tolist() == [1.0, 1.0] and metrics["rewards/unit_hangs/errors"] == 0.0


def test_malformed_reward_output_counts_as_error(temporary_reward):
    temporary_reward("unit_malformed", lambda completions, rows: torch.ones(3))
    _, per_fn, metrics = compute_rewards({"unit_malformed": 1.0}, COMPLETIONS, ROWS)
    assert per_fn["unit_malformed"].tolist() == [0.0, 0.0]
    assert metrics["rewards/unit_malformed/errors"] == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_rejected_for_its_completion_only(temporary_reward, bad):
    temporary_reward("unit_nonfinite", lambda completions, rows: torch.tensor([0.5, bad]))
    temporary_reward("unit_half", lambda completions, rows: torch.tensor([0.5, 0.5]))
    total, per_fn, metrics = compute_rewards({"unit_nonfinite": 2.0, "unit_half": 1.0}, COMPLETIONS, ROWS)
    assert total.tolist() == [1.5, 0.5]  # 2 x 0.5 + 0.5; the second gets only unit_half's 0.5
    assert per_fn["unit_nonfinite"][0] == 0.5 and torch.isnan(per_fn["unit_nonfinite"][1])
    assert metrics["rewards/unit_nonfinite/nonfinite"] == 1.0 and metrics["rewards/unit_nonfinite/errors"] == 0.0
    assert metrics["rewards/unit_nonfinite/mean"] == 0.5  # over the values kept


def test_values_beyond_the_bound_are_clamped_and_counted(temporary_reward):
    from mmpo.rewards.compute import REWARD_BOUND

    assert REWARD_BOUND == 1e6
    # 3e38 is finite in float32; 1e39 is not (it must be clamped, not read as inf); -2e6 is just beyond
    temporary_reward("unit_huge", lambda completions, rows: [3e38, 1e39])
    temporary_reward("unit_low", lambda completions, rows: [-2e6, 7.0])
    total, per_fn, metrics = compute_rewards({"unit_huge": 1.0, "unit_low": 0.5}, COMPLETIONS, ROWS, timeout_s=None)
    assert per_fn["unit_huge"].tolist() == [1e6, 1e6] and per_fn["unit_low"].tolist() == [-1e6, 7.0]
    assert metrics["rewards/unit_huge/clamped"] == 2.0 and metrics["rewards/unit_low/clamped"] == 1.0
    assert total.tolist() == [5e5, 1e6]  # 1e6 - 0.5e6; 1e6 + 3.5 clamped to 1e6
    assert metrics["rewards/total/clamped"] == 1.0 and metrics["rewards/unit_huge/nonfinite"] == 0.0


def test_list_output_is_accepted(temporary_reward):
    temporary_reward("unit_list", lambda completions, rows: [0.25] * len(completions))
    total, _, _ = compute_rewards({"unit_list": 2.0}, COMPLETIONS, ROWS)
    assert total.tolist() == [0.5, 0.5]  # 2 * 0.25


def test_no_timeout_runs_inline_on_main_thread():
    total, _, _ = compute_rewards({"accuracy": 1.0}, ["<answer>\\sqrt{12}</answer>"],
                                  [{"answer": "2\\sqrt{3}", "steps": []}], timeout_s=None)
    assert total.tolist() == [1.0]


def test_bad_arguments_fail_loudly():
    with pytest.raises(ValueError, match="unknown reward .nope.; registered: "):
        compute_rewards({"nope": 1.0}, COMPLETIONS, ROWS)
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        compute_rewards(None, COMPLETIONS, ROWS[:1])
