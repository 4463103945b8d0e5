"""`mmpo eval` end to end on a tiny saved model (build_tiny_vlm), plus its error paths."""

import json

import pytest
import torch

from mmpo.cli import main as mmpo_main
from mmpo.data.synthetic import TASKS
from mmpo.eval.cli import main as eval_main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from mmpo.vlm.factory import build_tiny_vlm

    torch.set_num_threads(1)
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "model", seed=0)


def test_eval_greedy_writes_reports(tiny_model, tmp_path, capsys):
    out = tmp_path / "eval"
    code = mmpo_main(["eval", "--model", str(tiny_model), "--benchmarks", f"synth/{TASKS[0]},synth/all",
                      "--synth-size", "3", "--limit", "3", "--max-new-tokens", "8", "--batch-size", "2",
                      "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"model", "model_type", "decoding", "benchmarks"}
    assert results["model_type"] == "vlm" and results["decoding"]["greedy"] is True
    assert list(results["benchmarks"]) == [f"synth/{TASKS[0]}", "synth/all"]
    for metrics in results["benchmarks"].values():
        assert {"num_items", "num_samples", "accuracy", "avg@1", "pass@1", "format_rate", "by_task",
                "seconds"} <= set(metrics)
        assert metrics["num_items"] == 3 and metrics["num_samples"] == 1
        assert 0.0 <= metrics["accuracy"] <= 1.0
    # --limit keeps a mix of tasks in synth/all
    assert len(results["benchmarks"]["synth/all"]["by_task"]) == min(3, len(TASKS))
    assert (out / "accuracy.png").stat().st_size > 1000
    assert "| synth/all | 3 | 1 |" in (out / "results.md").read_text()
    predictions = (out / "predictions" / "synth_all.jsonl").read_text().splitlines()
    assert len(predictions) == 3 and len(json.loads(predictions[0])["completions"]) == 1
    printed = capsys.readouterr().out
    assert "| benchmark | items | samples | accuracy | avg@1 | pass@1 |" in printed


def test_eval_sampled_reports_pass_at_k(tiny_model, tmp_path):
    out = tmp_path / "eval_k"
    code = eval_main(["--model", str(tiny_model), "--benchmarks", f"synth/{TASKS[0]}", "--synth-size", "2",
                      "--num-samples", "4", "--temperature", "1.0", "--max-new-tokens", "6", "--out", str(out),
                      "--no-progress"])
    assert code == 0
    metrics = json.loads((out / "results.json").read_text())["benchmarks"][f"synth/{TASKS[0]}"]
    assert metrics["num_samples"] == 4
    assert {"avg@4", "pass@1", "pass@2", "pass@4"} <= set(metrics)
    # pass@k never decreases with k, and pass@1 is the mean accuracy
    assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"]
    assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])


def test_eval_unknown_benchmark_lists_valid_names(tiny_model, tmp_path, capsys):
    code = eval_main(["--model", str(tiny_model), "--benchmarks", "synth/nope", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "synth/nope" in err and "synth/all" in err and f"synth/{TASKS[0]}" in err
    assert not (tmp_path / "results.json").exists()


def test_eval_rejects_a_path_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert eval_main(["--model", str(tmp_path / "empty"), "--benchmarks", "synth/all", "--out",
                      str(tmp_path / "o")]) == 2
    assert "not a model" in capsys.readouterr().err
    assert eval_main(["--model", str(tmp_path / "absent"), "--benchmarks", "synth/all", "--out",
                      str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_eval_greedy_with_k_is_refused(tiny_model, tmp_path):
    with pytest.raises(SystemExit):
        eval_main(["--model", str(tiny_model), "--benchmarks", "synth/all", "--num-samples", "2", "--greedy",
                   "--out", str(tmp_path)])


def test_eval_list(capsys):
    assert eval_main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "synth/all" in lines
    # named benchmarks come with the files they expect
    mathvista = next(index for index, line in enumerate(lines) if line.startswith("mathvista_testmini  [vlm]"))
    assert lines[mathvista + 1].startswith("    files: <data-dir>/MathVista/ holding AI4Math/MathVista split 'testmini'")


def test_evaluate_api_greedy_is_deterministic(tiny_model):
    from mmpo.eval.harness import evaluate
    from mmpo.eval.registry import synthetic_rows
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(tiny_model)
    rows = synthetic_rows(list(TASKS[:2]), size=2, seed=3)
    first = evaluate(model, processor, rows, max_new_tokens=6, batch_size=3, progress=False)
    second = evaluate(model, processor, rows, max_new_tokens=6, batch_size=3, progress=False)
    assert [p["completions"] for p in first["predictions"]] == [p["completions"] for p in second["predictions"]]
    flags = [flag for p in first["predictions"] for flag in p["correct"]]
    assert first["accuracy"] == pytest.approx(sum(flags) / len(flags))
    assert set(first["by_task"]) == set(TASKS[:2])
    assert model.training is False


@pytest.fixture(scope="module")
def tiny_dllm(tmp_path_factory):
    """A tiny masked-diffusion checkpoint saved by the dllm package (marker file included)."""
    from mmpo.dllm.modeling import TinyMaskPredictorConfig, build_tiny_mask_predictor, save_mask_predictor
    from mmpo.dllm.sampler import SamplerConfig
    from mmpo.dllm.task import ArithmeticTaskConfig, corpus
    from mmpo.dllm.tokenizer import train_char_tokenizer

    torch.manual_seed(0)
    tokenizer = train_char_tokenizer(corpus(ArithmeticTaskConfig(), size=50))
    model = build_tiny_mask_predictor(tokenizer, TinyMaskPredictorConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64))
    path = tmp_path_factory.mktemp("tiny_dllm") / "ckpt"
    save_mask_predictor(model, tokenizer, path,
                        generation={"sampler": vars(SamplerConfig(gen_length=8, block_length=4, steps=4))})
    return path


def test_eval_dispatches_dllm_checkpoints(tiny_dllm, tmp_path):
    out = tmp_path / "eval_dllm"
    code = eval_main(["--model", str(tiny_dllm), "--benchmarks", "mmpo/dllm/arith", "--limit", "3",
                      "--num-samples", "2", "--temperature", "1.0", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model_type"] == "dllm"
    metrics = results["benchmarks"]["mmpo/dllm/arith"]
    assert metrics["num_items"] == 3 and metrics["num_samples"] == 2
    assert {"avg@2", "pass@1", "pass@2"} <= set(metrics)


def test_eval_refuses_image_benchmarks_for_dllm(tiny_dllm, tmp_path, capsys):
    visual = next(task for task in TASKS if task != "arithmetic")
    assert eval_main(["--model", str(tiny_dllm), "--benchmarks", f"synth/{visual}", "--synth-size", "1",
                      "--out", str(tmp_path)]) == 2
    assert "text-only dLLM" in capsys.readouterr().err


def test_evaluate_sampling_is_seeded_without_touching_the_callers_rng(tiny_model):
    from mmpo.eval.harness import evaluate
    from mmpo.eval.registry import synthetic_rows
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(tiny_model)
    rows = synthetic_rows([TASKS[0]], size=2, seed=3)
    state = torch.get_rng_state()
    runs = [evaluate(model, processor, rows, num_samples=3, greedy=False, max_new_tokens=6, seed=seed,
                     progress=False) for seed in (7, 7, 8)]
    assert torch.equal(torch.get_rng_state(), state)
    texts = [[p["completions"] for p in run["predictions"]] for run in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_eval_rejects_unknown_dtype(tiny_model, tmp_path, capsys):
    assert eval_main(["--model", str(tiny_model), "--benchmarks", "synth/all", "--dtype", "float33",
                      "--out", str(tmp_path)]) == 2
    assert "unknown dtype 'float33'" in capsys.readouterr().err


def test_eval_prompt_style_selects_the_system_prompt(tiny_model, tmp_path, monkeypatch):
    """`--prompt-style steps` evaluates with StepGRPO's system prompt (the format it was trained on)."""
    from mmpo.data import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT
    from mmpo.vlm import rollout

    seen = []
    real_engine = rollout.HFGenerateEngine

    def recording_engine(model, processor, *, system_prompt, **kwargs):
        seen.append(system_prompt)
        return real_engine(model, processor, system_prompt=system_prompt, **kwargs)

    monkeypatch.setattr(rollout, "HFGenerateEngine", recording_engine)
    for style in ("steps", "think-answer"):
        code = eval_main(["--model", str(tiny_model), "--benchmarks", f"synth/{TASKS[0]}", "--synth-size", "2",
                          "--limit", "2", "--max-new-tokens", "4", "--prompt-style", style,
                          "--out", str(tmp_path / style), "--no-progress"])
        assert code == 0
    assert seen == [STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT]


def test_eval_mathvista_from_publisher_files_end_to_end(tiny_model, tmp_path, capsys):
    """`mmpo eval --benchmarks mathvista_testmini --data-dir DIR`: the publisher's parquet, the benchmark's
    prompt and scoring, per-item records; a missing benchmark folder fails before the model loads."""
    from benchmark_fixtures import mathvista_dir
    from mmpo.eval.benchmarks import judge
    from mmpo.eval.registry import load_benchmark_rows, resolve_benchmark

    data_dir = mathvista_dir(tmp_path / "data")
    out = tmp_path / "eval"
    code = mmpo_main(["eval", "--model", str(tiny_model), "--benchmarks", "mathvista_testmini", "--data-dir",
                      str(data_dir), "--max-new-tokens", "4", "--batch-size", "2", "--out", str(out),
                      "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["data_dir"] == str(data_dir)
    metrics = results["benchmarks"]["mathvista_testmini"]
    assert metrics["num_items"] == 4 and set(metrics["by_task"]) == {
        "geometry problem solving", "figure question answering", "textbook question answering"}
    lines = (out / "predictions" / "mathvista_testmini.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [record["id"] for record in records] == ["1", "2", "3", "4"]
    first = records[0]
    assert first["prompt"].endswith("(A) 3\n(B) 4\n(C) 5") and first["images"] == ["<embedded image 0>"]
    assert first["answer"] == "4" and len(first["completions"]) == len(first["extracted"]) == len(first["scores"]) == 1
    # each record holds what the benchmark's rule gives its completion, and accuracy is their mean
    rows = {row["id"]: row for row in load_benchmark_rows(resolve_benchmark("mathvista_testmini", data_dir=data_dir))}
    for record in records:
        assert (record["extracted"][0], record["scores"][0]) == judge(record["completions"][0], rows[record["id"]])
    assert metrics["accuracy"] == pytest.approx(sum(record["scores"][0] for record in records) / 4)

    code = eval_main(["--model", str(tmp_path / "not_loaded"), "--benchmarks", "chartqa_test", "--data-dir",
                      str(data_dir), "--out", str(tmp_path / "eval2")])
    err = capsys.readouterr().err
    assert code == 2 and "'chartqa_test'" in err and str(data_dir / "ChartQA") in err and "test-*.parquet" in err


def test_eval_with_tools_reports_tool_use_and_logs_each_answer(tmp_path):
    """`mmpo eval --tools calculator` on the calc task with a tiny text LM: multi-turn answers, the tool metrics equal
    what the per-answer records say, and each record holds the answer's conversation."""
    text = tmp_path / "text"
    assert mmpo_main(["build-tiny", "--kind", "text", "--out", str(text), "--vocab-size", "400", "--hidden-size", "32",
                      "--intermediate-size", "64", "--num-layers", "1"]) == 0
    out = tmp_path / "eval_tools"
    code = mmpo_main(["eval", "--model", str(text), "--benchmarks", "synth/calc", "--synth-size", "3",
                      "--num-samples", "2", "--temperature", "1.0", "--max-new-tokens", "12", "--tools", "calculator",
                      "--max-turns", "2", "--max-total-tokens", "60", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["tool_use"]["tools"] == ["calculator"] and results["tool_use"]["max_turns"] == 2
    metrics = results["benchmarks"]["synth/calc"]
    records = [json.loads(line) for line in (out / "predictions" / "synth_calc.jsonl").read_text().splitlines()]
    turns = [t for record in records for t in record["turns"]]
    calls = [c for record in records for c in record["tool_calls"]]
    assert len(turns) == len(calls) == 6 and all(1 <= t <= 2 for t in turns)
    assert metrics["turns_per_answer"] == pytest.approx(sum(turns) / 6)
    assert metrics["tool_calls_per_answer"] == pytest.approx(sum(calls) / 6)
    assert metrics["tool_call_rate"] == pytest.approx(sum(c > 0 for c in calls) / 6)
    for record in records:
        for messages, turn_count, completion in zip(record["messages"], record["turns"], record["completions"]):
            assert messages[0]["role"] == "user" and messages[0]["content"] == record["prompt"]
            assert sum(m["role"] == "assistant" for m in messages) == turn_count
            assert [m for m in messages if m["role"] == "assistant"][-1]["content"] == completion
    assert "tool_call_rate" in (out / "results.md").read_text() and "With tools: tools=['calculator']" in (
        out / "results.md").read_text()


def test_eval_with_an_unknown_tool_fails_before_loading(tmp_path, capsys):
    code = eval_main(["--model", str(tmp_path / "nowhere"), "--benchmarks", "synth/calc", "--tools", "abacus",
                      "--out", str(tmp_path / "out")])
    assert code == 2
    assert "unknown tool 'abacus'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
