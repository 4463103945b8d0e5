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


class DrawingEngine:
    """Sample k of a row is right when k is even; every call draws from torch's global generator and
    returns the draw in the text, so the seed's effect is visible."""

    def __init__(self, model, processor, **_):
        pass

    def generate(self, rows, *, num_samples, do_sample, temperature, **_):
        assert do_sample and temperature == 0.7
        texts = []
        for row in rows:
            for k in range(num_samples):
                answer = row["answer"] if k % 2 == 0 else "wrong"
                texts.append(f"<think>{float(torch.rand(())):.6f}</think><answer>{answer}</answer>")
        return types.SimpleNamespace(texts=texts)


def test_sampled_accuracy_is_avg_at_k_per_row_on_a_fixed_seed(monkeypatch):
    from mmpo.eval.heldout import heldout_texts, sampled_accuracy

    monkeypatch.setattr(rollout_module, "HFGenerateEngine", DrawingEngine)
    model = torch.nn.Linear(1, 1)
    torch.manual_seed(5)
    expected_next = torch.rand(())
    torch.manual_seed(5)
    # 3 samples per row: samples 0 and 2 are right -> 2/3 on every row
    assert sampled_accuracy(model, None, ROWS, samples=3, temperature=0.7, seed=11) == pytest.approx([2 / 3] * 3)
    assert torch.rand(()) == expected_next  # the caller's RNG stream is untouched
    first = heldout_texts(model, None, ROWS, samples=2, temperature=0.7, seed=11)
    assert first == heldout_texts(model, None, ROWS, samples=2, temperature=0.7, seed=11)
    assert first != heldout_texts(model, None, ROWS, samples=2, temperature=0.7, seed=12)
    assert len(first) == 6 and model.training
    with pytest.raises(ValueError, match="samples must be >= 1"):
        sampled_accuracy(model, None, ROWS, samples=0, temperature=0.7)
