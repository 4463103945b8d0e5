"""`mmpo quickstart --tiny`: the whole pipeline (build, eval, SFT, eval, GRPO, eval, plots) in seconds."""

import json

from mmpo.cli import main as mmpo_main
from mmpo.quickstart import STAGES, QuickstartConfig
from mmpo.quickstart import main as quickstart_main


def test_quickstart_tiny_smoke(tmp_path, capsys):
    out = tmp_path / "qs"
    assert mmpo_main(["quickstart", "--tiny", "--out", str(out), "--seed", "0", "--no-progress"]) == 0
    summary = json.loads((out / "quickstart.json").read_text())
    assert set(summary) == {"config", "seed", "accuracy", "timings_s", "paths", "grpo_improved_over_sft",
                            "grpo_vs_sft", "reward", "abstained"}
    # the abstention shares are those of the evaluations' completions (each a count out of eval_size x tasks)
    for stage, name in (("after SFT", "after_sft"), ("after GRPO", "after_grpo")):
        texts = [text for path in (out / "eval" / name / "predictions").glob("*.jsonl")
                 for line in path.read_text().splitlines() for text in json.loads(line)["completions"]]
        assert summary["abstained"][stage] == sum("<answer>unsure</answer>" in t for t in texts) / len(texts)
    tiny = QuickstartConfig.tiny()
    assert list(summary["accuracy"]) == list(STAGES)
    for stage in STAGES:
        assert set(summary["accuracy"][stage]) == {*tiny.tasks, "mean"}
        # each stage's accuracies are the ones its eval wrote, out of eval_size items per task,
        # and "mean" is their mean over tasks
        stage_dir = out / "eval" / stage.lower().replace(" ", "_")
        results = json.loads((stage_dir / "results.json").read_text())
        accuracy = summary["accuracy"][stage]
        for task in tiny.tasks:
            assert accuracy[task] == results["benchmarks"][f"synth/{task}"]["accuracy"]
            lines = (stage_dir / "predictions" / f"synth_{task}.jsonl").read_text().splitlines()
            items = [json.loads(line) for line in lines]
            assert len(items) == tiny.eval_size
            for item in items:  # a completion without an <answer> block cannot be graded correct
                for text, correct in zip(item["completions"], item["correct"]):
                    assert correct is False or "<answer>" in text, item["id"]
            assert accuracy[task] == sum(item["correct"][0] for item in items) / len(items)
        assert accuracy["mean"] == sum(accuracy[task] for task in tiny.tasks) / len(tiny.tasks)
    gain = summary["grpo_vs_sft"]  # paired over the same held-out items: the mean accuracies' difference
    assert gain["items"] == tiny.eval_size * len(tiny.tasks)
    assert abs(gain["gain"] - (summary["accuracy"]["after GRPO"]["mean"] - summary["accuracy"]["after SFT"]["mean"])) < 1e-12
    assert summary["grpo_improved_over_sft"] is (gain["shown"] and gain["gain"] > 0)
    assert summary["reward"]["steps"] == tiny.grpo_steps
    # every stage's artefacts are under --out
    for name in ("model_init/config.json", "sft/hf/config.json", "grpo/hf/config.json",
                 "grpo/logs/version_0/metrics.csv", "sft/checkpoints/last.ckpt", "grpo/checkpoints/last.ckpt",
                 "eval/before_sft/results.json", "eval/after_sft/results.json", "eval/after_grpo/results.json",
                 "results.md", "eval.png", "learning_curve.png"):
        assert (out / name).is_file(), name
    eval_results = json.loads((out / "eval" / "after_grpo" / "results.json").read_text())
    assert set(eval_results["benchmarks"]) == {f"synth/{task}" for task in tiny.tasks}
    printed = capsys.readouterr().out
    assert "| task | before SFT | after SFT | after GRPO |" in printed

    # Rerunning with the same --out reuses the finished stages instead of training again.
    assert quickstart_main(["--tiny", "--out", str(out), "--no-progress"]) == 0
    assert printed.count("already done") == 0
    assert capsys.readouterr().out.count("already done") == 6
    assert json.loads((out / "quickstart.json").read_text())["accuracy"] == summary["accuracy"]

    # ... but never mixes in stages made with other settings.
    assert quickstart_main(["--tiny", "--out", str(out), "--seed", "1", "--no-progress"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_quickstart_rejects_unknown_task(tmp_path, capsys):
    assert quickstart_main(["--tiny", "--tasks", "no_such_task", "--out", str(tmp_path)]) == 2
    assert "no_such_task" in capsys.readouterr().err


def test_paired_gain_and_verdict_on_hand_values():
    from mmpo.quickstart import paired_gain, verdict_line

    # 40 items: 10 fixed by GRPO, none broken -> +0.25 and every bootstrap replicate is > 0
    before = {f"i{k}": 0.0 for k in range(40)}
    after = {f"i{k}": 1.0 if k < 10 else 0.0 for k in range(40)}
    gain = paired_gain(before, after)
    assert gain["items"] == 40 and gain["gain"] == 0.25 and gain["shown"] is True
    assert 0 < gain["interval"][0] <= 0.25 <= gain["interval"][1]
    assert verdict_line(gain).startswith("GRPO improved on the SFT model on 40 held-out items: +0.250 (95% paired")
    # one fixed, one broken: gain 0, the interval straddles zero -> "not shown", never "improved"
    mixed = paired_gain({"a": 0.0, "b": 1.0, "c": 1.0}, {"a": 1.0, "b": 0.0, "c": 1.0})
    assert mixed["gain"] == 0.0 and mixed["shown"] is False
    line = verdict_line(mixed)
    assert line.endswith("a gain is not shown.") and "improved" not in line
    # only the items both evaluations scored are paired
    assert paired_gain({"a": 0.0, "x": 1.0}, {"a": 1.0, "y": 0.0})["items"] == 1


def test_reward_rise_reads_the_first_and_last_tenth(tmp_path):
    from mmpo.quickstart import reward_rise

    path = tmp_path / "metrics.csv"
    rows = ["step,rewards/total/mean,val/accuracy"] + [f"{k},{k / 10},"for k in range(20)] + ["20,,0.5"]
    path.write_text("\n".join(rows) + "\n")
    rise = reward_rise([path])
    assert rise == {"key": "rewards/total/mean", "steps": 20, "window": 2, "first": 0.05, "last": 1.85}


def test_quickstart_text_kind_trains_a_tiny_text_lm_on_the_text_tasks(tmp_path):
    from mmpo.quickstart import TEXT_QUICKSTART_TASKS
    from mmpo.vlm.factory import model_kind

    out = tmp_path / "qs_text"
    assert mmpo_main(["quickstart", "--kind", "text", "--tiny", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "quickstart.json").read_text())
    assert summary["config"]["kind"] == "text"
    assert summary["config"]["tasks"] == list(TEXT_QUICKSTART_TASKS) == ["inventory"]
    assert summary["config"]["sft_abstain_share"] == 0.8  # the same abstaining teacher as the VLM quickstart
    for stage in ("model_init", "sft/hf", "grpo/hf"):
        assert model_kind(json.loads((out / stage / "config.json").read_text())) == "text"
    assert set(summary["accuracy"]["after GRPO"]) == {*summary["config"]["tasks"], "mean"}


def test_text_kind_defaults_and_flags():
    """``--kind text``: the inventory task, the abstaining teacher (0.8 of red/blue/green), 100 GRPO steps; every
    flag still overrides, and the VLM defaults are untouched."""
    from mmpo.quickstart import build_parser, config_from_args

    def config(*argv):
        return config_from_args(build_parser().parse_args(list(argv)))

    text = config("--kind", "text")
    assert (text.kind, text.tasks, text.sft_abstain_share, text.sft_abstain_colours, text.grpo_steps) == (
        "text", ("inventory",), 0.8, ("red", "blue", "green"), 100)
    assert (text.sft_steps, text.eval_size) == (QuickstartConfig().sft_steps, QuickstartConfig().eval_size)
    plain = config("--kind", "text", "--abstain-share", "0", "--grpo-steps", "200",
                   "--tasks", "long_arithmetic,word_problem,countdown")
    assert (plain.tasks, plain.sft_abstain_share, plain.grpo_steps) == (
        ("long_arithmetic", "word_problem", "countdown"), 0.0, 200)
    assert config("--kind", "text", "--tiny").grpo_steps == QuickstartConfig.tiny().grpo_steps
    assert config() == QuickstartConfig()
