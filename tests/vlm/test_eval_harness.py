"""Harness: scoring, per-task summaries, answerer evaluation, model detection and dLLM dispatch."""

import types

import pytest
import torch

from mmpo.eval import harness
from mmpo.eval.harness import (
    NotAModelError,
    detect_model_type,
    evaluate_answerer,
    evaluate_checkpoint,
    score_completions,
)
from mmpo.eval.registry import BENCHMARKS, register_benchmark

ROWS = [
    {"id": "a0", "task": "add", "images": [], "problem": "1+1?", "answer": "2"},
    {"id": "a1", "task": "add", "images": [], "problem": "2+2?", "answer": "4"},
    {"id": "m0", "task": "mul", "images": [], "problem": "3*3?", "answer": "9"},
]


def exact_scorer(completions, rows):
    return torch.tensor([float(text.strip() == row["answer"]) for text, row in zip(completions, rows)])


class ScriptedAnswerer:
    """Answers from a fixed script {row id: [sample texts]}; records how it was called."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def answer(self, rows, num_samples, greedy):
        self.calls.append((len(rows), num_samples, greedy))
        return [self.script[row["id"]][:num_samples] for row in rows]


SCRIPT = {"a0": ["2", "3", "2", "5"], "a1": ["1", "1", "1", "1"], "m0": ["9", "9", "9", "9"]}


def test_score_completions_shapes_and_errors():
    correct, scores, extra = score_completions([["2", "x"], ["4", "4"], ["0", "9"]], ROWS, scorer=exact_scorer)
    assert correct == [[True, False], [True, True], [False, True]]
    assert scores == [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    assert extra == {}
    with pytest.raises(ValueError, match="same number of samples"):
        score_completions([["2"], ["4", "4"], ["9"]], ROWS, scorer=exact_scorer)
    with pytest.raises(ValueError, match="2 completion lists for 3 rows"):
        score_completions([["2"], ["4"]], ROWS, scorer=exact_scorer)


def test_evaluate_answerer_hand_computed():
    answerer = ScriptedAnswerer(SCRIPT)
    results = evaluate_answerer(answerer, ROWS, num_samples=4, greedy=False, batch_size=2, scorer=exact_scorer,
                                progress=False)
    # correct counts: a0 2/4, a1 0/4, m0 4/4 -> accuracy 6/12
    assert results["accuracy"] == pytest.approx(0.5)
    assert results["avg@4"] == pytest.approx(0.5)
    # pass@2 per item: a0 1 - C(2,2)/C(4,2) = 5/6, a1 0, m0 1
    assert results["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert results["pass@4"] == pytest.approx(2 / 3)
    assert results["by_task"]["add"]["accuracy"] == pytest.approx(2 / 8)
    assert results["by_task"]["mul"]["pass@1"] == pytest.approx(1.0)
    assert results["predictions"][0] == {"id": "a0", "task": "add", "prompt": "1+1?", "images": [], "answer": "2",
                                         "completions": ["2", "3", "2", "5"],
                                         # no <answer>/\boxed{} in these completions: nothing extracted
                                         "extracted": [None, None, None, None],
                                         "scores": [1.0, 0.0, 1.0, 0.0],
                                         "correct": [True, False, True, False]}
    # batches of 2 then 1, each asked for 4 sampled answers
    assert answerer.calls == [(2, 4, False), (1, 4, False)]


def test_evaluate_answerer_checks_shape():
    class Broken:
        def answer(self, rows, num_samples, greedy):
            return [["x"] for _ in rows]

    with pytest.raises(RuntimeError, match="wrong shape.*'a0'"):
        evaluate_answerer(Broken(), ROWS, num_samples=2, greedy=False, scorer=exact_scorer, progress=False)


def test_decoding_settings_are_checked():
    with pytest.raises(ValueError, match="identical samples"):
        evaluate_answerer(ScriptedAnswerer(SCRIPT), ROWS, num_samples=4, greedy=True, scorer=exact_scorer)
    with pytest.raises(ValueError, match="num_samples"):
        evaluate_answerer(ScriptedAnswerer(SCRIPT), ROWS, num_samples=0, greedy=True, scorer=exact_scorer)


def test_detect_model_type_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect_model_type(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotAModelError, match="not a model.*config.json"):
        detect_model_type(tmp_path / "notes.txt")
    with pytest.raises(NotAModelError, match="not a model"):
        detect_model_type(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert detect_model_type(tmp_path) == "vlm"


def test_dllm_checkpoints_go_to_the_dllm_answerer(tmp_path, monkeypatch):
    """A checkpoint the dLLM side recognises is evaluated through its answerer, with its benchmarks."""
    checkpoint = tmp_path / "dllm_ckpt"
    checkpoint.mkdir()
    answerer = ScriptedAnswerer(SCRIPT)
    fake_dllm_eval = types.SimpleNamespace(
        is_dllm_checkpoint=lambda path: path == str(checkpoint),
        load_answerer=lambda path, **gen_kwargs: answerer,
    )
    monkeypatch.setattr(harness, "_dllm_eval_module", lambda: fake_dllm_eval)
    saved = dict(BENCHMARKS)
    try:
        register_benchmark("toy/dllm_text", lambda: ROWS, modality="dllm", scorer=exact_scorer)
        results = evaluate_checkpoint(checkpoint, ["toy/dllm_text"], num_samples=4, greedy=False,
                                      out_dir=tmp_path / "out", progress=False)
    finally:
        BENCHMARKS.clear()
        BENCHMARKS.update(saved)
    assert results["model_type"] == "dllm"
    assert results["benchmarks"]["toy/dllm_text"]["accuracy"] == pytest.approx(0.5)
    assert "predictions" not in results["benchmarks"]["toy/dllm_text"]
    assert (tmp_path / "out" / "results.json").exists()
    assert (tmp_path / "out" / "predictions" / "toy_dllm_text.jsonl").read_text().count("\n") == 3
