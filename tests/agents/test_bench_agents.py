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
