"""Judge-scored evals through `mmpo eval --judge`: MathVista / MathVerse fixture files in the publishers' layouts,
a judge served over HTTP on the loopback address by the test; per-item records keep the rule's and the judge's
extraction, and the reported agreement equals the hand count. Also the docs/eval.md command, run as written."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmark_fixtures import mathverse_dir, mathvista_dir
from loopback_judge import LoopbackJudge
from mmpo.cli import main as mmpo_main
from mmpo.eval import harness
from mmpo.eval.judge_extraction import mathverse_prompt, mathverse_score_prompt, mathvista_prompt
from mmpo.eval.registry import load_benchmark_rows, resolve_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _tail(prompt: str) -> tuple[str, str]:
    """(stage, the item's own part of a judge prompt): what the judge reads after the in-context examples."""
    if prompt.endswith("Judgement:"):
        return "score", prompt.rsplit("[Question]: ", 1)[1]
    if prompt.endswith("Extracted Answer: "):
        return "mathverse", prompt.rsplit("Model response: ", 1)[1]
    return "mathvista", prompt.rsplit("\n\n", 2)[-2]


# MathVista fixture (benchmark_fixtures.mathvista_dir): 1 multiple choice (3/4/5, gold B), 2 float 1.45,
# 3 integer 12 (cm), 4 list [2007, 2008]. MathVerse (mathverse_dir): 1 choices in the text (gold B = 60°),
# 5 choices only in the image (gold B), 6 free form (gold 5).
COMPLETIONS = {
    ("mathvista", "1"): "Counting the corners gives four, so it is the second option.",  # rule: none (0)
    ("mathvista", "2"): "<answer>1.449</answer>",                 # rule: 1.45 (1)
    ("mathvista", "3"): "12",                                     # rule 1; MathVista's shortcut: no judge request
    ("mathvista", "4"): "The peak is between 2007 and 2008.",     # rule: no list (0)
    ("mathverse", "1"): "<answer>60°</answer>",                   # rule: option text -> B (1)
    ("mathverse", "5"): "The answer is (D)",                      # rule: D (0)
    ("mathverse", "6"): "AC = 3 + 2, so AC is five units long.",  # rule: no number (0)
}
JUDGE = {  # (stage, a piece of the item's part of the prompt) -> the judge's reply; anything else fails (HTTP 500)
    ("mathvista", COMPLETIONS["mathvista", "1"]): "B",
    ("mathvista", COMPLETIONS["mathvista", "2"]): "1.449",
    ("mathvista", COMPLETIONS["mathvista", "4"]): "[2007, 2008]",
    ("mathverse", COMPLETIONS["mathverse", "1"]): "Extracted Answer: 60°",
    ("mathverse", COMPLETIONS["mathverse", "6"]): "5",   # item 5's extraction request fails
    ("score", "[Model_answer] : 60°\n"): "Judgement: 1",
    ("score", "[Model_answer] : 5\n"): "1",
}


def _hand_judge(prompt: str) -> str | None:
    stage, tail = _tail(prompt)
    return next((reply for (kind, piece), reply in JUDGE.items() if kind == stage and piece in tail), None)


class _ScriptedEngine:
    """Stands in for HFGenerateEngine: the scripted completion of each item (the judge's side is under test)."""

    def __init__(self, model, processor, system_prompt=None):
        pass

    def generate(self, rows, *, num_samples, **decoding):
        family = lambda row: "mathverse" if row["task"] in ("Text Dominant", "Vision Only", "Text Lite") else "mathvista"
        return SimpleNamespace(texts=[COMPLETIONS[family(row), row["id"]] for row in rows for _ in range(num_samples)])


@pytest.fixture
def judge_server():
    server = LoopbackJudge(_hand_judge)
    yield server
    server.close()


def _data(tmp_path):
    data = tmp_path / "data"
    mathvista_dir(data)
    mathverse_dir(data)
    return data


def test_judge_scored_eval_records_both_extractions_and_the_hand_counted_agreement(tmp_path, judge_server,
                                                                                   monkeypatch, capsys):
    data = _data(tmp_path)
    monkeypatch.setattr(harness, "load_model_for_eval", lambda *args, **kwargs: ("vlm", (torch.nn.Linear(1, 1), None)))
    monkeypatch.setattr("mmpo.vlm.rollout.HFGenerateEngine", _ScriptedEngine)
    settings = tmp_path / "judge.yaml"  # the judge as a config: rewards.models settings
    settings.write_text(f"url: {judge_server.url}\nmax_retries: 0\nmax_concurrency: 2\n")
    out = tmp_path / "eval"
    code = mmpo_main(["eval", "--model", str(tmp_path / "ckpt"), "--benchmarks",
                      "mathvista_testmini,mathverse_testmini,mathverse_testmini/text_lite", "--data-dir", str(data),
                      "--judge", str(settings), "--judge-model", "extractor",
                      "--judge-benchmarks", "mathvista,mathverse_testmini", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["judge"]["url"] == judge_server.url and results["judge"]["model"] == "extractor"
    assert results["judge"]["benchmarks"] == ["mathvista_testmini", "mathverse_testmini"]
    assert "judge" not in results["benchmarks"]["mathverse_testmini/text_lite"]  # not selected
    assert {body["model"] for body in judge_server.bodies} == {"extractor"}

    vista = [json.loads(line) for line in (out / "predictions" / "mathvista_testmini.jsonl").read_text().splitlines()]
    assert [(r["extracted"][0], r["scores"][0]) for r in vista] == [
        (None, 0.0), ("1.45", 1.0), ("12", 1.0), ("Thepeakisbetween2007and2008", 0.0)]   # the rule's side
    assert [(r["judge_extracted"][0], r["judge_scores"][0], r["judge_failed"][0]) for r in vista] == [
        ("B", 1.0, False), ("1.449", 1.0, False), ("12", 1.0, False), ("[2007, 2008]", 1.0, False)]
    assert [r["agree"][0] for r in vista] == [False, True, True, False]
    # hand count: 2 of 4 answers scored alike; the judge scores all 4 right, the rule 2
    assert results["benchmarks"]["mathvista_testmini"]["judge"] == {
        "protocol": "mathvista", "items": 4.0, "rule_accuracy": 0.5, "judge_accuracy": 1.0, "agreement": 0.5,
        "judge_failed": 0.0}
    assert results["benchmarks"]["mathvista_testmini"]["accuracy"] == 0.5  # the headline stays the rule's

    verse = [json.loads(line) for line in (out / "predictions" / "mathverse_testmini.jsonl").read_text().splitlines()]
    assert [(r["extracted"][0], r["scores"][0]) for r in verse] == [
        ("B", 1.0), ("D", 0.0), ("AC = 3 + 2, so AC is five units long", 0.0)]
    assert [(r["judge_extracted"][0], r["judge_scores"][0], r["judge_failed"][0]) for r in verse] == [
        ("60°", 1.0, False), (None, None, True), ("5", 1.0, False)]
    assert [r["agree"][0] for r in verse] == [True, None, False]
    assert [r["judgement_replies"][0] for r in verse] == ["Judgement: 1", None, "1"]
    # hand count: of the 2 answers the judge scored, 1 agrees with the rule; item 5's request failed
    assert results["benchmarks"]["mathverse_testmini"]["judge"] == {
        "protocol": "mathverse", "items": 3.0, "rule_accuracy": pytest.approx(1 / 3), "judge_accuracy": 1.0,
        "agreement": 0.5, "judge_failed": 1.0}

    # the judge read exactly the official prompts: 3 MathVista extractions (item 3 took the shortcut),
    # 3 MathVerse extractions and the 2 second-stage judgements of the extractions it got
    rows = {(family, row["id"]): row for family, name in (("mathvista", "mathvista_testmini"),
                                                          ("mathverse", "mathverse_testmini"))
            for row in load_benchmark_rows(resolve_benchmark(name, data_dir=data))}
    expected = [mathvista_prompt(rows["mathvista", i]["problem"], COMPLETIONS["mathvista", i]) for i in "124"]
    expected += [mathverse_prompt(COMPLETIONS["mathverse", i]) for i in "156"]
    expected += [mathverse_score_prompt(rows["mathverse", "1"]["question"], "B", "60°"),
                 mathverse_score_prompt("Find the length of AC.", "5", "5")]
    assert sorted(judge_server.prompts) == sorted(expected)
    printed = capsys.readouterr().out
    assert "judge_accuracy | agreement | judge_failed |" in printed
    assert "| mathverse_testmini | 3 | 1 | 0.333 | 0.333 | 0.333 | 1.000 | 0.500 | 1.000 |" in printed


def test_rule_scored_mathverse_and_bad_judge_options(tmp_path, judge_server, monkeypatch, capsys):
    data = _data(tmp_path)
    monkeypatch.setattr(harness, "load_model_for_eval", lambda *args, **kwargs: ("vlm", (torch.nn.Linear(1, 1), None)))
    monkeypatch.setattr("mmpo.vlm.rollout.HFGenerateEngine", _ScriptedEngine)
    out = tmp_path / "eval"
    assert mmpo_main(["eval", "--model", str(tmp_path / "ckpt"), "--benchmarks", "mathverse_testmini", "--data-dir",
                      str(data), "--judge", judge_server.url, "--mathverse-scoring", "rule", "--out", str(out),
                      "--no-progress"]) == 0
    judged = json.loads((out / "results.json").read_text())["benchmarks"]["mathverse_testmini"]["judge"]
    # no second stage: the rule scores the extractions "60°" (-> B, 1) and "5" (1); the rule scored the answers 1
    # and 0, so 1 of the 2 judge-scored answers agrees; item 5 failed
    assert (judged["judge_accuracy"], judged["agreement"], judged["judge_failed"]) == (1.0, 0.5, 1.0)
    assert not any(prompt.endswith("Judgement:") for prompt in judge_server.prompts)

    def error(*extra):
        code = mmpo_main(["eval", "--model", str(tmp_path / "ckpt"), "--benchmarks", "mathvista_testmini,synth/all",
                          "--data-dir", str(data), "--out", str(tmp_path / "bad"), *extra])
        return code, capsys.readouterr().err

    code, err = error("--judge", judge_server.url, "--judge-benchmarks", "synth/all")
    assert code == 2 and err.endswith(
        "mmpo eval: error: --judge-benchmarks: 'synth/all' has no judge extraction protocol; judge-scored "
        "benchmarks are those of ('mathvista', 'mathverse')\n")
    code, err = error("--judge", "gpt-4o")
    assert code == 2 and "is not an http(s) URL, a settings .yaml file, a model directory or file.py:factory" in err
    with pytest.raises(SystemExit):
        mmpo_main(["eval", "--model", "m", "--benchmarks", "mathvista_testmini", "--out", "o",
                   "--judge-benchmarks", "mathvista"])
    assert "--judge-model and --judge-benchmarks need --judge" in capsys.readouterr().err


def _documented_command() -> str:
    text = (ROOT / "docs" / "eval.md").read_text()
    match = re.search(r"<!-- example: judge-scored eval -->\n```bash\n(.*?)\n```", text, re.S)
    assert match, "docs/eval.md lost its judge-scored eval example"
    lines = match.group(1).replace("\\\n", " ").splitlines()
    (command,) = [line for line in lines if line.startswith("mmpo eval ")]
    return command


def test_the_documented_judge_scored_eval_runs_as_written(tmp_path, monkeypatch):
    """The docs/eval.md command on a tiny model (real generation), with JUDGE_URL naming the test's judge."""
    from mmpo.vlm.factory import build_tiny_vlm

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    build_tiny_vlm(tmp_path / "runs" / "tiny" / "sft", seed=0)
    data = tmp_path / "data" / "benchmarks"
    mathvista_dir(data)
    mathverse_dir(data)
    server = LoopbackJudge(lambda prompt: {"score": "Judgement: 1", "mathverse": "B"}.get(_tail(prompt)[0], "B"))
    try:
        monkeypatch.setenv("JUDGE_URL", server.url)
        argv = shlex.split(os.path.expandvars(_documented_command()))
        assert argv[:2] == ["mmpo", "eval"]
        assert mmpo_main(argv[1:] + ["--no-progress"]) == 0
    finally:
        server.close()
    out = tmp_path / "runs" / "eval_judged"
    results = json.loads((out / "results.json").read_text())
    assert results["judge"]["model"] == "Qwen/Qwen2.5-7B-Instruct"
    expected_prompts = []
    for name, protocol in (("mathvista_testmini", "mathvista"), ("mathverse_testmini", "mathverse")):
        records = [json.loads(line) for line in (out / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        rows = {row["id"]: row for row in load_benchmark_rows(resolve_benchmark(name, data_dir=data))}
        agree = scored = 0
        for record in records:
            completion, row = record["completions"][0], rows[record["id"]]
            assert len(record["extracted"]) == len(record["judge_extracted"]) == 1
            if protocol == "mathverse":
                # every stage-1 reply is "B" and every judgement 1
                assert record["judge_extracted"] == ["B"] and record["judge_scores"] == [1.0]
                expected_prompts += [mathverse_prompt(completion), mathverse_score_prompt(row["question"],
                                                                                          row["answer"], "B")]
            elif record["judge_extracted"] != ["B"]:  # MathVista's shortcut: the response itself, no request
                assert record["judge_extracted"] == [completion]
            else:
                expected_prompts.append(mathvista_prompt(row["problem"], completion))
            scored += 1
            agree += record["judge_scores"][0] == record["scores"][0]
            assert record["agree"] == [record["judge_scores"][0] == record["scores"][0]]
        judged = results["benchmarks"][name]["judge"]
        assert judged["judge_failed"] == 0.0 and judged["agreement"] == pytest.approx(agree / scored)
    assert sorted(server.prompts) == sorted(expected_prompts)
