"""bench/bench_agents.py with a tiny budget: one seed of calc (SFT, GRPO and ARPO, each evaluated with and without the
calculator on the same held-out items), resumable, and the report's tables and paired contrasts."""

from __future__ import annotations

import json
from pathlib import Path

from bench_support import load_bench


def test_bench_agents_one_seed_end_to_end(tmp_path, monkeypatch):
    bench = load_bench("bench_agents")
    monkeypatch.setitem(bench.MODEL_SIZE, "text", dict(vocab_size=400, hidden_size=32, intermediate_size=64,
                                                       num_layers=1))
    monkeypatch.setattr(bench, "SFT_OVERRIDES", ["--data.init_args.train_size=8", "--data.init_args.batch_size=2"])
    monkeypatch.setattr(bench, "RL_OVERRIDES", [
        "--data.init_args.train_size=8", "--data.init_args.batch_size=2", "--model.init_args.sampling.num_generations=2",
        "--model.init_args.agent.max_total_tokens=40"])
    monkeypatch.setattr(bench, "TOOL_LIMITS", dict(max_turns=2, max_total_tokens=40))
    results = bench.run_seed("calc", 0, tmp_path, sft_steps=2, rl_steps=1, eval_size=2, max_new_tokens=8,
                             algos=["grpo"])
    assert set(results["eval"]) == {"sft/with_tools", "sft/without_tools", "grpo/with_tools", "grpo/without_tools"}
    items = results["eval"]["sft/with_tools"]["ids"]
    for key, entry in results["eval"].items():
        assert len(entry["correct"]) == 2 and entry["ids"] == items  # the same held-out items everywhere
        assert entry["accuracy"] == sum(entry["correct"]) / 2
        assert ("tool_call_rate" in entry) == key.endswith("/with_tools")
    assert results["training_tool_calls"]["grpo"] is not None
    tiny = json.loads((tmp_path / "calc" / "s0" / "base" / "mmpo_tiny.json").read_text())
    assert tiny["individual_digits"] is True  # calc's tool tokenizer: one token per digit
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "calc" / "s0" / "sft")
    pieces = tokenizer.tokenize("Compute 4821 * 37 - 1290.")
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("4821371290")
    stored = json.loads((tmp_path / "calc" / "s0" / "results.json").read_text())
    assert stored == json.loads(json.dumps(results))

    def no_more_fits(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(bench, "_fit", no_more_fits)
    monkeypatch.setattr(bench, "_evaluate", no_more_fits)
    assert bench.run_seed("calc", 0, tmp_path, sft_steps=2, rl_steps=1, eval_size=2, max_new_tokens=8,
                          algos=["grpo"])["eval"] == results["eval"]
    text = bench.report(tmp_path)
    assert "| grpo/with_tools - grpo/without_tools |" in text and "| grpo/with_tools - sft/with_tools |" in text
    assert "| sft/with_tools |" in text and (tmp_path / "report.md").read_text() == text


def test_bench_agents_codebook_from_a_shared_sft_start(tmp_path, monkeypatch):
    """--sft-start: every seed copies one SFT checkpoint and trains RL from it (no SFT fit), recorded in the results;
    --rl-lr reaches the RL fit as an override."""
    from mmpo.vlm.factory import build_tiny_text_lm, tool_task_corpus

    bench = load_bench("bench_agents")
    start = build_tiny_text_lm(tmp_path / "start", vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                               corpus=tool_task_corpus("codebook", ["codebook"], n=20))
    monkeypatch.setattr(bench, "RL_OVERRIDES", [
        "--data.init_args.train_size=8", "--data.init_args.batch_size=2", "--model.init_args.sampling.num_generations=2",
        "--model.init_args.agent.max_total_tokens=40"])
    monkeypatch.setattr(bench, "TOOL_LIMITS", dict(max_turns=2, max_total_tokens=40))
    fits = []
    real_fit = bench._fit

    def recording_fit(config, run, model_path, output, steps, seed, extra):
        fits.append((config, model_path, list(extra)))
        return real_fit(config, run, model_path, output, steps, seed, extra)

    monkeypatch.setattr(bench, "_fit", recording_fit)
    out = tmp_path / "out"
    assert bench.main(["run", "--task", "codebook", "--seeds", "3", "--sft-steps", "2", "--rl-steps", "1",
                       "--eval-size", "2", "--max-new-tokens", "8", "--algos", "grpo", "--rl-lr", "0.002",
                       "--sft-start", str(start), "--out", str(out)]) == 0
    (config, model_path, extra), = fits  # no SFT fit: only GRPO, from the copied start
    assert config == "codebook_grpo_tiny.yaml" and model_path == out / "codebook" / "s3" / "sft"
    assert "--model.init_args.optim.lr=0.002" in extra and "--model.init_args.seed=3" in extra
    results = json.loads((out / "codebook" / "s3" / "results.json").read_text())
    assert results["sft_start"] == str(start) and results["sft_steps"] is None
    assert "--model.init_args.optim.lr=0.002" in results["rl_overrides"]
    assert (model_path / "config.json").read_text() == (start / "config.json").read_text()
    assert set(results["eval"]) == {"sft/with_tools", "sft/without_tools", "grpo/with_tools", "grpo/without_tools"}
    assert f"one shared SFT start ({start})" in (out / "report.md").read_text()
    # a second seed from the same start: RL and its own evaluations only, the start's are the first seed's
    evaluated = []
    real_evaluate = bench._evaluate

    def recording_evaluate(checkpoint, *args, **kwargs):
        evaluated.append(checkpoint.name)
        return real_evaluate(checkpoint, *args, **kwargs)

    monkeypatch.setattr(bench, "_evaluate", recording_evaluate)
    assert bench.main(["run", "--task", "codebook", "--seeds", "4", "--rl-steps", "1", "--eval-size", "2",
                       "--max-new-tokens", "8", "--algos", "grpo", "--sft-start", str(start), "--out", str(out)]) == 0
    assert evaluated == ["grpo", "grpo"]
    second = json.loads((out / "codebook" / "s4" / "results.json").read_text())
    assert {key: second["eval"][key] for key in ("sft/with_tools", "sft/without_tools")} == {
        key: results["eval"][key] for key in ("sft/with_tools", "sft/without_tools")}


def test_training_curves_read_per_step_calls_from_the_metrics(tmp_path):
    """``_training_curves``: per trained step, the trajectory means and the executed calls (every
    ``tools/<name>/calls``, unparseable ``invalid`` ones included, errors not added again); rows without agent
    metrics are skipped."""
    bench = load_bench("bench_agents")
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(
        "step,agent/tool_calls_mean,agent/turns_mean,rewards/accuracy/mean,tools/codebook/calls,tools/codebook/errors,"
        "tools/invalid/calls,val/accuracy\n"
        "0,2.5,3.5,0.25,70,3,10,\n"
        "1,2.0,3.0,0.5,60,0,,\n"
        "1,,,,,,,0.75\n")
    curves = bench._training_curves(tmp_path / "run")
    assert curves == {"tool_calls_per_trajectory": [2.5, 2.0], "executed_tool_calls": [80.0, 60.0],
                      "turns_per_trajectory": [3.5, 3.0], "batch_accuracy": [0.25, 0.5]}
    assert bench._training_tool_calls(tmp_path / "run") == 2.25


def test_tool_call_contrasts_by_hand():
    """ARPO - GRPO rows: eval calls paired by item, training values paired by step. Three seeds whose per-seed
    mean differences are 1, 0, 0.5: estimate 0.5, seed-t 0.5 -+ t(0.975, 2) * 0.5 / sqrt(3) = 0.5 -+ 4.303 * 0.2887
    = [-0.742, +1.742]; ratio of means (3 + 2 + 2.5) / (2 + 2 + 2) = 1.25."""
    bench = load_bench("bench_agents")
    arpo, grpo = [[3.0, 3.0], [2.0, 2.0], [3.0, 2.0]], [[2.0, 2.0]] * 3

    def seed(i):
        return {"eval": {"arpo/with_tools": {"tool_calls": arpo[i], "correct": [1.0, 0.0]},
                         "grpo/with_tools": {"tool_calls": grpo[i], "correct": [1.0, 1.0]}},
                "training": {"arpo": {"tool_calls_per_trajectory": arpo[i], "executed_tool_calls": [40.0, 40.0, 9.0],
                                      "batch_accuracy": [0.5, 0.5]},
                             "grpo": {"tool_calls_per_trajectory": grpo[i], "executed_tool_calls": [80.0, 80.0],
                                      "batch_accuracy": [0.5, 0.5]}}}

    header, rule, calls, accuracy, per_trajectory, executed, batch = bench.tool_call_contrasts([seed(i) for i in range(3)])
    assert calls == ("| arpo - grpo: tool calls per item (eval, paired by item) | +0.500 | "
                     f"{calls.split(' | ')[2]} | [-0.742, +1.742] | 3 | 1.25 |")
    assert per_trajectory.split(" | ")[1:] == calls.split(" | ")[1:]
    assert accuracy.split(" | ")[1] == "-0.500" and accuracy.endswith("| 3 | 0.50 |")
    # executed calls: only the steps both runs have (the third ARPO step is cut), 40 - 80 on every step
    assert executed.split(" | ")[1:4] == ["-40.000", "[-40.000, -40.000]", "[-40.000, -40.000]"]
    assert executed.endswith("| 0.50 |") and batch.split(" | ")[1] == "+0.000"
    assert header.startswith("| contrast |") and rule.startswith("| --- |")
    missing = bench.tool_call_contrasts([{"eval": seed(0)["eval"]}])
    assert missing[4] == "| arpo - grpo: tool calls per trajectory (training, paired by step) | n/a | n/a | n/a | 0 | n/a |"


def test_bench_agents_codebook_pair_records_calls_per_item_and_per_step(tmp_path, monkeypatch):
    """codebook_pair, GRPO and ARPO from a shared start (1 step each): the evaluation with the tool stores each
    item's tool calls (their mean is the summary's calls per answer) under the task's own turn budget, every RL run
    its per-step curves, and the report the ARPO - GRPO tool-call rows."""
    from mmpo.vlm.factory import build_tiny_text_lm, tool_task_corpus

    bench = load_bench("bench_agents")
    start = build_tiny_text_lm(tmp_path / "start", vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                               corpus=tool_task_corpus("codebook_pair", ["codebook"], n=20))
    monkeypatch.setattr(bench, "RL_OVERRIDES", [
        "--data.init_args.train_size=8", "--data.init_args.batch_size=2", "--model.init_args.sampling.num_generations=2",
        "--model.init_args.agent.max_total_tokens=40"])
    limits = []
    real_tool_use = __import__("mmpo.eval.harness", fromlist=["ToolUse"]).ToolUse

    def recording_tool_use(tools, **kwargs):
        limits.append(kwargs)
        return real_tool_use(tools, **{**kwargs, "max_total_tokens": 40})

    monkeypatch.setattr("mmpo.eval.harness.ToolUse", recording_tool_use)
    results = bench.run_seed("codebook_pair", 0, tmp_path / "out", sft_steps=2, rl_steps=1, eval_size=2,
                             max_new_tokens=8, sft_start=start)
    assert limits and all(kwargs == {"max_turns": 5, "max_total_tokens": 448} for kwargs in limits)
    for name in ("sft", "grpo", "arpo"):
        entry = results["eval"][f"{name}/with_tools"]
        assert len(entry["tool_calls"]) == 2 and sum(entry["tool_calls"]) / 2 == entry["tool_calls_per_answer"]
        assert "tool_calls" not in results["eval"][f"{name}/without_tools"]
    for algo in ("grpo", "arpo"):
        curves = results["training"][algo]
        assert all(len(values) == 1 for values in curves.values())
        assert curves["tool_calls_per_trajectory"][0] == results["training_tool_calls"][algo]
    text = bench.report(tmp_path / "out")
    assert "| arpo - grpo: tool calls per item (eval, paired by item) | " in text
    assert "training tool calls executed / step" in text
def test_diagnose_scores_the_box_and_the_answer_on_their_own_tokens(tmp_path, monkeypatch):
    """``diagnose`` on zoom_digit with a stub scorer: log 0.25 on every token that is a lone digit, log 0.75 on the
    others. The answer (one digit) then costs exactly ln 4 per token and is never 'exact'; the box's tokens (the
    coordinates and commas) cost ln 4 where a token is a lone digit and ln 4/3 elsewhere."""
    import math

    import torch
    from tiny_vlm_support import build_small_vlm

    import mmpo.vlm.logprobs
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import load_model

    bench = load_bench("bench_agents")
    path = build_small_vlm(tmp_path / "vlm")
    tokenizer = load_model(path)[1].tokenizer
    digit_ids = {i for i in range(len(tokenizer)) if tokenizer.decode([i]) in set("0123456789")}

    def stub(model, prompts, ids, attention, **kwargs):
        low = torch.tensor([[int(t) in digit_ids for t in row] for row in ids])
        values = torch.where(low, math.log(0.25), math.log(0.75))
        return values * attention, None

    monkeypatch.setattr(mmpo.vlm.logprobs, "completion_log_probs", stub)
    result = bench.diagnose(tmp_path / "vlm", "zoom_digit", ["image_zoom_in_tool"], 3)
    assert math.isclose(result["answer"]["nll_per_token"], math.log(4), rel_tol=1e-6)
    assert result["answer"]["exact"] == 0.0 and result["answer"]["rows"] == result["bbox_2d"]["rows"] == 3
    levels = [row["difficulty"] for row in make_items("zoom_digit", 3, seed=bench.EVAL_SEED, split="test")]
    assert list(result["answer"]["by_difficulty"]) == sorted(set(levels))
    for level, part in result["answer"]["by_difficulty"].items():
        assert part["rows"] == levels.count(level) and part["exact"] == 0.0
        assert math.isclose(part["nll_per_token"], math.log(4), rel_tol=1e-6)
    expected = []
    for row in make_items("zoom_digit", 3, seed=bench.EVAL_SEED, split="test"):
        call = row["tool_trace"][0]["content"]
        lo, hi = bench._spans(call)["bbox_2d"]
        assert call[lo:hi].count(",") == 3 and call[hi] == "]"  # the four coordinates
        encoded = tokenizer(call, add_special_tokens=False, return_offsets_mapping=True)
        expected += [math.log(4) if t in digit_ids else math.log(4 / 3)
                     for t, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]) if a < hi and b > lo]
    assert math.isclose(result["bbox_2d"]["nll_per_token"], sum(expected) / len(expected), rel_tol=1e-6)
    assert result["bbox_2d"]["exact"] == (0.0 if any(v > 1 for v in expected) else 1.0)
    assert bench._spans('<think>x</think><answer>42</answer>') == {"answer": (24, 26)}
    assert bench._spans('<think>x 42</think><answer>42</answer>', "42") == {"answer": (27, 29), "answer_first": (9, 11)}


def test_bench_agents_per_seed_sft_start_and_rl_overrides(tmp_path, monkeypatch):
    """--sft-start with {seed} gives each seed its own start; --rl-override KEY=VALUE reaches every RL fit as --KEY=VALUE;
    the report names per-seed starts; a malformed override is refused."""
    import pytest

    bench = load_bench("bench_agents")
    monkeypatch.setattr(bench, "RL_OVERRIDES", [])
    calls = []

    def fake_run_seed(task, seed, out, **kwargs):
        calls.append((task, seed, kwargs["sft_start"], list(bench.RL_OVERRIDES)))
        correct = [1.0, 0.0] if seed == 0 else [1.0, 1.0]
        entry = {"accuracy": sum(correct) / 2, "correct": correct, "ids": ["a", "b"]}
        results = {"task": task, "seed": seed, "sft_steps": None, "rl_steps": 3, "eval_size": 2,
                   "sft_start": str(kwargs["sft_start"]), "training_tool_calls": {},
                   "eval": {"sft/with_tools": {**entry, "correct": [1.0, 0.0], "accuracy": 0.5}, "grpo/with_tools": entry}}
        bench.atomic_write_json(out / task / f"s{seed}" / "results.json", results)
        return results

    monkeypatch.setattr(bench, "run_seed", fake_run_seed)
    assert bench.main(["run", "--task", "codebook", "--seeds", "0", "2", "--sft-start", "starts/s{seed}/sft400",
                       "--rl-override", "model.init_args.loss.beta=0.01", "--rl-override=--trainer.max_epochs=3",
                       "--rl-lr", "3e-4", "--out", str(tmp_path)]) == 0
    overrides = ["--model.init_args.optim.lr=0.0003", "--model.init_args.loss.beta=0.01", "--trainer.max_epochs=3"]
    assert calls == [("codebook", 0, Path("starts/s0/sft400"), overrides),
                     ("codebook", 2, Path("starts/s2/sft400"), overrides)]
    text = (tmp_path / "report.md").read_text()
    assert "per-seed SFT starts (starts/s0/sft400, starts/s2/sft400)" in text
    # seed 0: RL - SFT = 0 on both items; seed 2: +1 on item b -> mean over seeds of the per-seed means = 0.25
    assert "| grpo/with_tools - sft/with_tools | +0.250 |" in text
    with pytest.raises(SystemExit):
        bench.main(["run", "--task", "codebook", "--rl-override", "beta", "--out", str(tmp_path)])


def test_by_difficulty_sums_right_answers_per_level_by_hand():
    bench = load_bench("bench_agents")
    entries = [{"correct": [1.0, 0.0, 1.0, 0.0], "difficulty": [1, 2, 3, 3]},
               {"correct": [0.0, 1.0, 1.0, 1.0], "difficulty": [1, 2, 3, 3]},
               {"correct": [1.0]}]  # an older record without levels: skipped
    assert bench.by_difficulty(entries) == {1: (1.0, 2), 2: (1.0, 2), 3: (3.0, 4)}
    assert bench.by_difficulty([{"correct": [1.0]}]) == {}


def test_bench_agents_evaluates_on_the_validation_split(tmp_path, monkeypatch):
    """--eval-split val: the evaluation items are the val split's (ids and levels recorded), the split is recorded and
    named in the report, and a seed directory evaluated on the other split is refused before anything runs."""
    import pytest

    from mmpo.vlm.factory import build_tiny_text_lm, tool_task_corpus

    bench = load_bench("bench_agents")
    start = build_tiny_text_lm(tmp_path / "start", vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                               corpus=tool_task_corpus("calc", ["calculator"], n=20), individual_digits=True)
    monkeypatch.setattr(bench, "TOOL_LIMITS", dict(max_turns=2, max_total_tokens=40))
    entry = bench._evaluate(start, "calc", ["calculator"], 3, 4, tmp_path / "eval", split="val")
    assert entry["ids"] == ["calc-val-s1234-0", "calc-val-s1234-1", "calc-val-s1234-2"]
    assert entry["difficulty"] == [1, 2, 3] and len(entry["correct"]) == 3
    assert entry["accuracy"] == sum(entry["correct"]) / 3

    calls = []

    def fake_run_seed(task, seed, out, **kwargs):
        calls.append(kwargs["eval_split"])
        results = {"task": task, "seed": seed, "sft_steps": None, "rl_steps": 3, "eval_size": 3,
                   "eval_split": kwargs["eval_split"], "training_tool_calls": {},
                   "eval": {"sft/with_tools": {**entry}, "grpo/with_tools": {**entry, "correct": [1.0, 1.0, 0.0]}}}
        bench.atomic_write_json(out / task / f"s{seed}" / "results.json", results)
        return results

    monkeypatch.setattr(bench, "run_seed", fake_run_seed)
    out = tmp_path / "out"
    assert bench.main(["run", "--task", "calc", "--seeds", "0", "--eval-split", "val", "--out", str(out)]) == 0
    assert calls == ["val"]
    text = (out / "report.md").read_text()
    assert "3 validation items (not the test split)" in text
    assert "- grpo/with_tools: level 1 1/1, level 2 1/1, level 3 0/1" in text
    monkeypatch.undo()
    with pytest.raises(ValueError, match="evaluated on the val split, not test"):
        load_bench("bench_agents").run_seed("calc", 0, out, sft_steps=1, rl_steps=1, eval_size=3)


def test_bench_agents_model_size_and_sft_aux_task(tmp_path, monkeypatch):
    """--model-size KEY=INTEGER reaches the tiny builder's sizes of the task's kind; --sft-aux-task mixes another task
    into the SFT's data (one override naming both, after the task's own); a
    malformed size, or an aux task of another kind, is refused."""
    import pytest

    bench = load_bench("bench_agents")
    monkeypatch.setitem(bench.MODEL_SIZE, "vlm", {})
    monkeypatch.setattr(bench, "SFT_OVERRIDES", [])
    monkeypatch.setattr(bench, "RL_OVERRIDES", [])
    built, fits = [], []
    monkeypatch.setattr("mmpo.vlm.factory.build_tiny_vlm", lambda path, **kwargs: built.append(kwargs))
    monkeypatch.setattr("mmpo.vlm.factory.tool_task_corpus", lambda task, tools, vlm: [task])

    def fake_fit(config, run, model_path, output, steps, seed, extra):
        fits.append((config, list(extra)))
        raise RuntimeError("stop after the SFT's arguments")

    monkeypatch.setattr(bench, "_fit", fake_fit)
    with pytest.raises(RuntimeError, match="stop after"):
        bench.main(["run", "--task", "zoom_digit_box", "--seeds", "0", "--sft-steps", "5", "--model-size",
                    "min_pixels=12544", "--model-size", "vision_depth=2", "--sft-aux-task", "zoom_digit_box_read",
                    "--out", str(tmp_path)])
    assert built == [dict(seed=0, min_pixels=12544, vision_depth=2, corpus=["zoom_digit_box"])]
    assert fits == [("zoom_sft_tiny.yaml", ["--data.init_args.seed=0", "--data.init_args.tasks=[zoom_digit_box]",
                                            "--data.init_args.tasks=[zoom_digit_box,zoom_digit_box_read]"])]
    assert bench.SFT_OVERRIDES == ["--data.init_args.tasks=[zoom_digit_box,zoom_digit_box_read]"]
    for bad in (["--model-size", "vision_depth=two"], ["--model-size", "vision_depth"],
                ["--sft-aux-task", "codebook"], ["--sft-aux-task", "nope"]):
        with pytest.raises(SystemExit):
            bench.main(["run", "--task", "zoom_digit_box", *bad, "--out", str(tmp_path)])
