"""mmpo.eval.heldout: the bench scripts' held-out accuracy, on a scripted engine with hand-counted answers."""

from __future__ import annotations

import types

import pytest
import torch

import mmpo.vlm.rollout as rollout_module
from mmpo.eval.heldout import heldout_accuracy

ROWS = [
    {"id": "c0", "task": "count", "images": [], "problem": "how many?", "answer": "3"},
    {"id": "c1", "task": "count", "images": [], "problem": "how many?", "answer": "5"},
    {"id": "s0", "task": "size", "images": [], "problem": "which?", "answer": "7"},
]
#: the scripted greedy answer per row: c0 right, c1 wrong, s0 right
ANSWERS = {"c0": "<think>x</think><answer>3</answer>", "c1": "<think>x</think><answer>4</answer>",
           "s0": "<think>x</think><answer>7</answer>"}


class ScriptedEngine:
    calls: list = []

    def __init__(self, model, processor, *, system_prompt="default", **_):
        ScriptedEngine.calls.append(("init", system_prompt))

    def generate(self, rows, *, num_samples, do_sample, **_):
        ScriptedEngine.calls.append(("generate", len(rows), num_samples, do_sample))
        return types.SimpleNamespace(texts=[ANSWERS[row["id"]] for row in rows for _ in range(num_samples)])


def test_heldout_accuracy_per_task_and_overall(monkeypatch):
    ScriptedEngine.calls = []
    monkeypatch.setattr(rollout_module, "HFGenerateEngine", ScriptedEngine)
    model = torch.nn.Linear(1, 1)
    accuracy = heldout_accuracy(model, None, ROWS, system_prompt=None, max_new_tokens=8, batch_size=2)
    # count: 1 of 2; size: 1 of 1; all: 2 of 3 (items, not tasks, weigh alike)
    assert accuracy == pytest.approx({"count": 0.5, "size": 1.0, "all": 2 / 3})
    assert list(accuracy) == ["count", "size", "all"]
    # greedy, one sample per row, in batches of 2 then 1, with the system prompt asked for
    assert ScriptedEngine.calls == [("init", None), ("generate", 2, 1, False), ("generate", 1, 1, False)]
    assert model.training  # the harness restores the train/eval mode
