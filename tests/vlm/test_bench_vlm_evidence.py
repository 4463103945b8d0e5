"""bench/bench_vlm_evidence.py (issue 18): the geometry solution mix, the perception-error rule, the scoring,
the paired contrasts and the report, on hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench_support import load_bench
from mmpo.eval.stats import paired_difference
from mmpo.files import atomic_write_json

evidence = load_bench("bench_vlm_evidence")

AUX = "<auxiliary>Draw a line through C parallel to AB.</auxiliary>"
EXTERIOR = {"id": "ext-1", "task": "geometry_aux", "aux_helps": True, "answer": "110", "steps": [
    "The two angles are 30 and 80.", AUX, "The parallel line copies angle A (30) and angle B (80) at C.",
    "30 + 80 = 110."]}
INTERIOR = {"id": "int-1", "task": "geometry_aux", "aux_helps": False, "answer": "70", "steps": [
    "The two angles are 30 and 80.", "30 + 80 = 110.", "180 - 110 = 70."]}


def test_mix_auxiliary_rewrites_both_kinds_when_flipped():
    exterior = evidence.mix_auxiliary(EXTERIOR, seed=0, share=1.0)
    assert exterior["steps"] == ["The two angles are 30 and 80.", "The interior angle at C is 180 - 30 - 80 = 70.",
                                 "The exterior angle is 180 - 70 = 110."]
    assert exterior["expert_trace"] == ("<think>The two angles are 30 and 80. The interior angle at C is 180 - 30 - 80 "
                                        "= 70. The exterior angle is 180 - 70 = 110.</think><answer>110</answer>")
    interior = evidence.mix_auxiliary(INTERIOR, seed=0, share=1.0)
    assert interior["steps"] == ["The two angles are 30 and 80.", AUX,
                                 "The parallel line copies angle A (30) and angle B (80) at C.", "30 + 80 = 110.",
                                 "180 - 110 = 70."]
    assert EXTERIOR["steps"][1] == AUX  # the input row is not modified


def test_mix_auxiliary_share_zero_keeps_the_row_and_the_choice_is_a_stable_hash():
    assert evidence.mix_auxiliary(EXTERIOR, seed=0, share=0.0) is EXTERIOR
    rows = [dict(EXTERIOR, id=f"ext-{k}") for k in range(400)]
    flipped = [evidence.mix_auxiliary(row, seed=3, share=0.5) is not row for row in rows]
    assert flipped == [evidence.mix_auxiliary(row, seed=3, share=0.5) is not row for row in rows]
    assert 160 <= sum(flipped) <= 240  # a hash: about half, not a fixed pattern
    assert flipped != [evidence.mix_auxiliary(row, seed=4, share=0.5) is not row for row in rows]


COUNT_ROW = {"id": "c1", "task": "count_shapes", "answer": "2", "problem": "How many green shapes are in the image?",
             "key_steps": [["3 shapes", "three shapes"], ["2 of them are green", "2 green"]]}


def test_perception_error_is_a_wrong_answer_without_the_first_key_step():
    right = "<think>The image shows 3 shapes. 2 of them are green.</think><answer>2</answer>"
    misread = "<think>The image shows 4 shapes. 3 of them are green.</think><answer>3</answer>"
    reasoning = "<think>The image shows 3 shapes. 3 of them are green.</think><answer>3</answer>"
    assert evidence.perception_error(right, COUNT_ROW, True) is False
    assert evidence.perception_error(misread, COUNT_ROW, False) is True
    assert evidence.perception_error(reasoning, COUNT_ROW, False) is False
    assert evidence.perception_error(misread, dict(COUNT_ROW, key_steps=[]), False) is False
    # whole words only: "13 shapes" is not the reading "3 shapes"
    assert evidence.perception_error("<think>13 shapes.</think><answer>3</answer>", COUNT_ROW, False) is True
    assert evidence.mentions("It shows THREE shapes.", ["3 shapes", "three shapes"]) is True
    # bar_chart: the perceptual step is the bar's value (key step 1), not the bar count
    bars = {"task": "bar_chart", "key_steps": [["2 bars"], ["red bar reaches line 3", "value is 3"]]}
    assert evidence.perception_error("There are 2 shapes. The red bar reaches line 3.", bars, False) is False
    assert evidence.perception_error("There are 2 bars. The red bar reaches line 4.", bars, False) is True
    # compare_size: both size readings are perceptual
    sizes = {"task": "compare_size", "key_steps": [["red shape is large"], ["green shape is small"]]}
    assert evidence.perception_error("The red shape is large. The green shape is large.", sizes, False) is True
    assert evidence.perception_error("The red shape is large. The green shape is small.", sizes, False) is False


def test_score_texts_per_item_values():
    steps_text = ("### Image Description: shapes.\n### Rationales: I count.\n### Step 1: The image shows 3 shapes.\n"
                  "### Step 2: 2 of them are green.\n### The final answer is: 2")
    aux_text = f"<think>{AUX} The image shows 4 shapes.</think><answer>1</answer>"
    scores = evidence.score_texts([steps_text, aux_text], [COUNT_ROW, COUNT_ROW])
    assert scores["texts"] == [steps_text, aux_text]
    assert scores["correct"] == [True, False]
    assert scores["key_step_frac"] == [1.0, 0.0]
    assert scores["step_valid"] == [True, False]
    assert scores["uses_aux"] == [False, True]
    assert scores["perception_error"] == [False, True]


def test_contrast_hand_values():
    # seed 0: 2/4 -> 4/4 (+0.5); seed 1: 3/4 -> 4/4 (+0.25): estimate 0.375; seed-t half width
    # t(0.975, 1) * sd / sqrt(2) = 12.7062 * 0.176777 / 1.414214 = 1.58828
    summary = paired_difference([[1, 1, 1, 1], [1, 1, 1, 1]], [[0, 0, 1, 1], [0, 1, 1, 1]], n_boot=2000)
    assert summary["estimate"] == pytest.approx(0.375)
    assert summary["per_seed"] == pytest.approx([0.5, 0.25])
    assert summary["seed_t"] == pytest.approx((0.375 - 1.58828, 0.375 + 1.58828), abs=1e-4)
    low, high = summary["bootstrap"]
    assert 0.0 <= low <= 0.375 <= high <= 1.0
    assert "excludes 0" in evidence._interval({"estimate": 0.1, "bootstrap": (0.02, 0.2), "seed_t": (0.01, 0.3)})
    assert "includes 0" in evidence._interval({"estimate": 0.1, "bootstrap": (-0.02, 0.2), "seed_t": (0.01, 0.3)})


def test_training_metrics_first_and_last_fifth(tmp_path):
    logs = tmp_path / "logs" / "version_0"
    logs.mkdir(parents=True)
    lines = ["epoch,step,x,sparse"] + [f"0,{k},{k},{'7' if k == 3 else ''}" for k in range(10)]
    (logs / "metrics.csv").write_text("\n".join(lines) + "\n")
    metrics = evidence.training_metrics(tmp_path)
    assert metrics == {"x": {"first": 0.5, "last": 8.5}}  # epoch/step dropped, one-value columns dropped


def _write_run(out: Path, experiment: str, algo: str, seed: int, correct: list[bool], **extra) -> None:
    final = {"correct": correct, "key_step_frac": [0.0] * len(correct), "step_valid": [False] * len(correct),
             "uses_aux": [False] * len(correct), "perception_error": [False] * len(correct)}
    final.update(extra)
    run = {"experiment": experiment, "algo": algo, "seed": seed, "final": final, "tasks": ["t1", "t1", "t2", "t2"],
           "aux_helps": [False] * 4, "curve": {"2": correct}, "train_metrics": {"ahpo/gate_on_frac": {
               "first": 1.0, "last": 0.5}, "rewards/accuracy/mean": {"first": 0.0, "last": 0.25}}}
    atomic_write_json(evidence.run_path(out, experiment, algo, seed), run)


def test_report_tables_from_run_files(tmp_path):
    start = {"correct": [False, False, True, False], "tasks": ["t1", "t1", "t2", "t2"],
             "key_step_frac": [0.0] * 4, "step_valid": [False] * 4, "uses_aux": [False] * 4,
             "perception_error": [False] * 4}
    atomic_write_json(tmp_path / "starts" / "sft_weak.json", start)
    _write_run(tmp_path, "weak", "grpo", 0, [False, False, True, False])
    _write_run(tmp_path, "weak", "grpo", 1, [False, False, True, False])
    _write_run(tmp_path, "weak", "ahpo", 0, [True, True, True, False])
    _write_run(tmp_path, "weak", "ahpo", 1, [True, False, True, True])
    text = evidence.report(tmp_path)
    # start: t1 0/2, t2 1/2, all 0.25; AHPO: t1 (2/2 + 1/2) / 2 = 0.75, t2 (1/2 + 2/2) / 2 = 0.75, all 0.75
    assert "| start | - | 0.000 | 0.500 | 0.250 | | |" in text
    assert "| grpo | 2 | 0.000 | 0.500 | 0.250 | +0.000 [+0.000, +0.000]" in text
    ahpo = next(line for line in text.splitlines() if line.startswith("| ahpo |"))
    assert ahpo.startswith("| ahpo | 2 | 0.750 | 0.750 | 0.750 | +0.500 [")
    assert ahpo.count("+0.500 [") == 2  # vs start and vs GRPO: both +0.5 (GRPO stayed at the start)
    assert "- ahpo: gate open 1.000 -> 0.500 of the prompts" in text
    assert "- ahpo: rollout accuracy on new prompts 0.000 -> 0.250 (first -> last fifth), change +0.250" in text
    assert "curve ahpo (step: accuracy (vs start, 95% CI)): 2: 0.750 (+0.500 [" in text
    assert math.isfinite(json.loads((tmp_path / "runs" / "weak__ahpo__s1.json").read_text())["seed"])


def test_report_perception_gap_and_error_share_from_texts(tmp_path):
    from mmpo.data.solution import render_solution

    rows = evidence.eval_rows(evidence.MAIN_TASKS, 1)
    assert [row["task"] for row in rows] == list(evidence.MAIN_TASKS)
    right = render_solution(rows[0])
    # compare_size with a wrong size reading (perception error); bar_chart read right, answer wrong (reasoning)
    big, small = rows[1]["key_steps"][0][0], rows[1]["key_steps"][1][0]
    misread = render_solution(rows[1]).replace(small, small.replace("small", "large"))
    assert big in misread and small not in misread
    reasoning = render_solution(rows[2]).replace(f"<answer>{rows[2]['answer']}</answer>", "<answer>99</answer>")
    result = {"texts": [right, misread, reasoning], "correct": [True, False, False],
              "correct_masked": [False, False, False], "tasks": list(evidence.MAIN_TASKS)}
    atomic_write_json(tmp_path / "starts" / "sft.json", result)
    result["sampled_accuracy"] = [0.5, 0.25, 0.0]
    atomic_write_json(tmp_path / "starts" / "sft.json", result)
    for seed in (0, 1):
        _write_run(tmp_path, "main", "grpo", seed, [True, False, False], texts=result["texts"],
                   correct_masked=[False, False, False], sampled_accuracy=[0.75, 0.5, 0.0])
        _write_run(tmp_path, "main", "mapo", seed, [True, False, False], texts=result["texts"],
                   correct_masked=[False, False, False], sampled_accuracy=[0.75, 0.5, 0.25 * seed])
    text = evidence.report(tmp_path)
    # start and runs: accuracy 1/3, masked 0 -> gap +0.333; errors 2, perception errors 1 -> share 0.5
    assert "perception gap +0.333; perception errors 0.500 of the errors" in text
    assert "- grpo: perception gap +0.333 (+0.333 [" in text
    assert "perception errors 0.500 of the errors (per seed 0.50, 0.50); perception-error rate 0.333 of the items " \
           "(start 0.333)" in text
    assert "- mapo: perception gap" in text and "(start 0.333), vs GRPO +0.000 [+0.000, +0.000]" in text
    # sampled: start 0.25, GRPO 0.4167 (+0.1667 on every seed); MAPO seed 0 = GRPO, seed 1 +0.0833 above it
    # (item diffs 0.25, 0.25, 0: the bootstrap over items varies; the seed-t interval is a point)
    assert "- grpo: held-out sampled accuracy 0.417 (start 0.250), vs start +0.167 [" in text
    assert "(seed-t [+0.167, +0.167]; excludes 0)" in text
    assert "- mapo: held-out sampled accuracy 0.458 (start 0.250), vs start +0.208 [" in text
    assert "vs GRPO +0.042 [" in text


def test_claim_lets_one_worker_take_a_run(tmp_path):
    path = evidence.run_path(tmp_path, "main", "grpo", 0)
    path.parent.mkdir(parents=True)
    assert evidence.claim(path) is True
    assert evidence.claim(path) is False  # a second worker skips it
    assert path.with_name(path.name + ".claim").read_text().isdigit()


def test_sampled_accuracy_averages_each_rows_contiguous_samples(monkeypatch):
    rows = [dict(COUNT_ROW, id="a"), dict(COUNT_ROW, id="b", answer="3")]
    texts = ["<answer>2</answer>", "<answer>1</answer>", "<answer>2</answer>",  # row a: 2 of 3 correct
             "<answer>3</answer>", "<answer>3</answer>", "<answer>3</answer>"]  # row b: 3 of 3
    seen = {}

    def fake_texts(model, processor, rows_, **kwargs):
        seen.update(kwargs)
        return texts

    import mmpo.eval.heldout as heldout

    monkeypatch.setattr(heldout, "heldout_texts", fake_texts)  # the bench scores through the package
    values = evidence.sampled_accuracy(None, None, rows, system_prompt="s", max_new_tokens=8, samples=3,
                                       temperature=0.7)
    assert values == pytest.approx([2 / 3, 1.0])
    assert seen["samples"] == 3 and seen["temperature"] == 0.7


def test_claim_left_by_a_stopped_worker_is_taken_again(tmp_path):
    import subprocess
    import sys

    path = evidence.run_path(tmp_path, "weak", "tapo", 0)
    path.parent.mkdir(parents=True)
    marker = path.with_name(path.name + ".claim")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid no longer runs: the claim is stale
    marker.write_text(str(gone.pid))
    assert evidence.claim_is_stale(marker) is True
    assert evidence.claim(path) is True and marker.read_text() == str(__import__("os").getpid())
    assert evidence.claim(path) is False  # this process runs: the claim holds
    marker.write_text("")  # a claim being written is not stale
    assert evidence.claim_is_stale(marker) is False and evidence.claim(path) is False


def test_resolve_out_paths_only_marked_strings_at_any_depth(tmp_path):
    settings = {"library": "<out>/starts/lib.json", "loss": {"beta": 0.0, "note": "<out>/x"}, "name": "out/<out>/"}
    assert evidence.resolve_out_paths(settings, tmp_path) == {
        "library": str(tmp_path / "starts" / "lib.json"), "loss": {"beta": 0.0, "note": str(tmp_path / "x")},
        "name": "out/<out>/"}
    assert settings["library"] == "<out>/starts/lib.json"  # the experiment table is not changed


def test_all_wrong_group_frac_hand_values():
    # group 0: 0, 0 (all wrong); group 1: 0, 1 (one right); group 2: -0.5, 0 (all wrong: <= 0) -> 2 of 3
    assert evidence.all_wrong_group_frac([0, 0, 0, 1, -0.5, 0], [0, 0, 1, 1, 2, 2]) == pytest.approx(2 / 3)
    assert evidence.all_wrong_group_frac([1, 0], [5, 5]) == 0.0
    assert math.isnan(evidence.all_wrong_group_frac([], []))


def test_with_group_counts_adds_the_metric_and_keeps_the_rewards():
    import torch

    class Base:
        def compute_rewards(self, rollout):
            return torch.tensor([0.0, 0.0, 1.0, 0.0]), {"base": 1.0}

    class Rollout:
        group_ids = torch.tensor([0, 0, 1, 1])

    counted = evidence.with_group_counts(Base)
    assert issubclass(counted, Base) and counted.__name__ == "Base"
    rewards, metrics = counted().compute_rewards(Rollout())
    assert rewards.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert metrics == {"base": 1.0, "evidence/all_wrong_group_frac": 0.5}


def test_algos_filter_the_jobs_seed_major():
    from argparse import Namespace

    args = Namespace(seeds=2, experiments="weak", algos="tapo,grpo")
    assert evidence.jobs(args) == [("weak", "grpo", 0), ("weak", "tapo", 0), ("weak", "grpo", 1), ("weak", "tapo", 1)]
    assert [job[1] for job in evidence.jobs(Namespace(seeds=1, experiments="weak", algos=None))] == ["grpo", "ahpo",
                                                                                                      "tapo"]
    with pytest.raises(SystemExit, match="unknown algorithm"):
        evidence.jobs(Namespace(seeds=1, experiments="weak", algos="tap"))
    assert evidence.EXPERIMENTS["weak"].algos["tapo"][1] == {"library": "<out>/starts/sft_weak_tapo_library.json"}


def test_report_all_wrong_groups_and_tapo_rewards(tmp_path):
    start = {"correct": [False] * 4, "tasks": ["t1", "t1", "t2", "t2"]}
    atomic_write_json(tmp_path / "starts" / "sft_weak.json", start)
    key = "evidence/all_wrong_group_frac"
    # GRPO seeds: last fifth 1.0, 0.75; TAPO: 0.5, 0.75 -> differences -0.5, 0.0, mean -0.25
    for seed, (grpo_last, tapo_last) in enumerate([(1.0, 0.5), (0.75, 0.75)]):
        _write_run(tmp_path, "weak", "grpo", seed, [False, False, False, seed == 1])
        _write_run(tmp_path, "weak", "tapo", seed, [seed == 0, False, False, False])
        for algo, last in (("grpo", grpo_last), ("tapo", tapo_last)):
            path = evidence.run_path(tmp_path, "weak", algo, seed)
            run = json.loads(path.read_text())
            run["train_metrics"] = {key: {"first": 1.0, "last": last}}
            if algo == "tapo":
                run["train_metrics"].update({"tapo/guided_reward_mean": {"first": 0.0, "last": 0.5},
                                             "tapo/unguided_reward_mean": {"first": 0.0, "last": 0.25},
                                             "tapo/unguided_all_wrong_group_frac": {"first": 1.0, "last": 0.8}})
            atomic_write_json(path, run)
    text = evidence.report(tmp_path)
    assert "- grpo: all-wrong groups 1.000 -> 0.875 (first -> last fifth, 2 seeds)" in text
    # seed-t over (-0.5, 0.0): mean -0.25, sd 0.3536, se 0.25, t(0.975, 1) 12.706 -> +-3.177
    assert ("- tapo: all-wrong groups 1.000 -> 0.625 (first -> last fifth, 2 seeds), last fifth vs GRPO -0.250 "
            "seed-t [-3.427, +2.927]; guided reward 0.000 -> 0.500, unguided 0.000 -> 0.250, groups all wrong "
            "without the guided rollouts 0.800 (last fifth)") in text
    # accuracy: GRPO 0.125 per seed mean, TAPO 0.125; paired per seed (+1/4, -1/4) -> estimate 0
    tapo = next(line for line in text.splitlines() if line.startswith("| tapo |"))
    assert tapo.startswith("| tapo | 2 | 0.250 | 0.000 | 0.125 | +0.125 [") and "+0.000 [" in tapo
