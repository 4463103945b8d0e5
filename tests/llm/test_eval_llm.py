"""`mmpo eval` on a text-only LM and the synthetic text tasks (synth/text, synth/<text task>): the held-out
test split, scored by the accuracy reward (countdown expressions included)."""

from __future__ import annotations

import json

import torch
from tiny_vlm_support import build_small_text_lm

from mmpo.cli import main
from mmpo.data.synthetic import TEXT_TASKS, make_items
from mmpo.eval.harness import score_completions
from mmpo.eval.registry import available_benchmarks, resolve_benchmark
from mmpo.rewards import accuracy_reward


def test_synth_text_is_the_text_tasks_test_split():
    assert "synth/text" in available_benchmarks()
    rows = resolve_benchmark("synth/text", synth_size=2, synth_seed=0).loader()
    assert sorted({row["task"] for row in rows}) == sorted(TEXT_TASKS) and len(rows) == 6
    expected = {r["id"] for task in TEXT_TASKS for r in make_items(task, 2, seed=0, split="test")}
    assert {row["id"] for row in rows} == expected


def test_eval_scores_reference_and_wrong_answers_of_text_tasks():
    rows = [row for task in TEXT_TASKS for row in make_items(task, 2, seed=0, split="test")]
    completions = [[row["expert_trace"], "<think></think><answer>-1</answer>"] for row in rows]
    correct, scores, _ = score_completions(completions, rows)
    assert correct == [[True, False]] * len(rows) and scores == [[1.0, 0.0]] * len(rows)


def test_mmpo_eval_on_a_text_lm(tmp_path):
    torch.set_num_threads(1)
    model = build_small_text_lm(tmp_path / "text")
    out = tmp_path / "eval"
    assert main(["eval", "--model", model, "--benchmarks", "synth/text,synth/countdown", "--synth-size", "2",
                 "--synth-seed", "0", "--max-new-tokens", "8", "--batch-size", "3", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == ["synth/text", "synth/countdown"]
    text = results["benchmarks"]["synth/text"]
    assert text["num_items"] == 6 and sorted(text["by_task"]) == sorted(TEXT_TASKS)
    assert results["benchmarks"]["synth/countdown"]["num_items"] == 2
    # the reported accuracy is the accuracy reward of the recorded greedy completions
    records = [json.loads(line) for line in (out / "predictions" / "synth_text.jsonl").read_text().splitlines()]
    rows = {r["id"]: r for task in TEXT_TASKS for r in make_items(task, 2, seed=0, split="test")}
    scored = accuracy_reward([r["completions"][0] for r in records], [rows[r["id"]] for r in records])
    assert text["accuracy"] == float(scored.mean())
