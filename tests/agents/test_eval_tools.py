"""`mmpo eval --tools`: the tool-use metrics on hand values (the CLI run: tests/e2e/test_eval_cli.py)."""

from __future__ import annotations

import pytest


def test_eval_tool_metrics_on_hand_values():
    """`mmpo eval --tools` aggregates: 4 answers (2 items x 2 samples) with turns 1, 2, 3, 2 and tool calls 0, 1, 2, 1
    -> tool-call rate 3/4, 1 call and 2 turns per answer; each item gets its own answers' turns, calls and
    conversations."""
    from mmpo.eval.harness import ToolUse, _ToolRunner
    from mmpo.tools.env import ToolStats

    runner = _ToolRunner.__new__(_ToolRunner)
    runner.settings = ToolUse(("calculator",))
    runner.turns, runner.calls = [1, 2, 3, 2], [0, 1, 2, 1]
    runner.messages = [[{"role": "user", "content": str(i)}] for i in range(4)]
    runner.stats = ToolStats()
    runner.stats.add("calculator")
    runner.stats.add("calculator", timeout=True)
    results = {"predictions": [{"id": "a"}, {"id": "b"}]}
    runner.report(results, num_samples=2)
    assert results["tool_call_rate"] == 0.75 and results["tool_calls_per_answer"] == 1.0
    assert results["turns_per_answer"] == 2.0 and results["tools"] == ["calculator"]
    assert results["tools/calculator/calls"] == 2.0 and results["tools/calculator/timeouts"] == 1.0
    assert results["predictions"][1] == {"id": "b", "turns": [3, 2], "tool_calls": [2, 1],
                                         "messages": [[{"role": "user", "content": "2"}],
                                                      [{"role": "user", "content": "3"}]]}
    with pytest.raises(ValueError, match="at least one tool"):
        ToolUse(())
