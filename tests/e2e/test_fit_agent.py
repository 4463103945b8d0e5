"""The calc tool-use pipeline through the CLI: build the tiny text LM, 2 steps of configs/agent/calc_sft_tiny.yaml
(tool traces, tool answers out of the loss), then 2 steps of calc_grpo_tiny.yaml (multi-turn rollouts with the
sandboxed calculator), with the rollout log holding each trajectory's turns and tool calls."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.vlm.factory import load_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "agent"


def _common(tmp_path: Path, name: str) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path / name}", f"--trainer.logger.init_args.save_dir={tmp_path / name}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / name / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=2", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--data.init_args.train_size=8", "--data.init_args.val_size=2",
        "--data.init_args.batch_size=2",
    ]


def _logged(log_dir: Path) -> dict[str, str]:
    (path,) = log_dir.glob("**/metrics.csv")
    logged: dict[str, str] = {}
    for row in csv.DictReader(path.open()):
        logged.update({key: value for key, value in row.items() if value})
    return logged


def _tiny_base_then_sft(tmp_path: Path, task: str) -> Path:
    """Build the tiny text LM, train ``configs/agent/{task}_sft_tiny.yaml`` 2 steps from it (logs under
    ``tmp_path / "sft"``), check that the weights moved and the SFT metrics were logged; returns the SFT output."""
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
                 "--intermediate-size", "64", "--num-layers", "1"]) == 0
    sft_out = tmp_path / f"{task}_sft"
    assert main(["fit", "-c", str(CONFIGS / f"{task}_sft_tiny.yaml"), *_common(tmp_path, "sft"),
                 f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={sft_out}",
                 "--model.init_args.val_max_new_tokens=8"]) == 0
    model, _ = load_vlm(base)
    trained, _ = load_vlm(sft_out)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters()))
    assert {"losses/sft", "val/accuracy", "val/tool_calls"} <= set(_logged(tmp_path / "sft"))
    return sft_out


def test_calc_sft_then_grpo_with_the_calculator(tmp_path):
    sft_out = _tiny_base_then_sft(tmp_path, "calc")

    grpo_out = tmp_path / "calc_grpo"
    assert main(["fit", "-c", str(CONFIGS / "calc_grpo_tiny.yaml"), *_common(tmp_path, "grpo"),
                 f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={grpo_out}",
                 "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=8",
                 "--model.init_args.agent.max_total_tokens=40"]) == 0
    logged = _logged(tmp_path / "grpo")
    assert {"agent/turns_mean", "agent/tool_calls_mean", "agent/env_tokens_mean", "losses/policy",
            "val/accuracy"} <= set(logged)
    records = [json.loads(line) for line in (tmp_path / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2  # 2 steps x 2 prompts x 2 samples
    assert {record["step"] for record in records} == {0, 1}
    for record in records:
        assert 1 <= record["turns"] <= 3 and record["tool_calls"] >= 0
        assert [m["role"] for m in record["messages"]][:2] == ["user", "assistant"]
        assert sum(m["role"] == "assistant" for m in record["messages"]) == record["turns"]


def test_zoom_sft_then_grpo_with_the_zoom_tool(tmp_path):
    """configs/agent/zoom_{sft,grpo}_tiny.yaml, 2 steps each, on a small tiny VLM: the crop comes back as an image."""
    from tiny_vlm_support import build_small_vlm

    base = build_small_vlm(tmp_path / "vlm_base")
    sft_out = tmp_path / "zoom_sft"
    assert main(["fit", "-c", str(CONFIGS / "zoom_sft_tiny.yaml"), *_common(tmp_path, "sft"),
                 f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={sft_out}",
                 "--model.init_args.val_max_new_tokens=8"]) == 0
    model, _ = load_vlm(base)
    trained, _ = load_vlm(sft_out)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters()))
    logged = _logged(tmp_path / "sft")
    assert {"losses/sft", "val/accuracy", "val/tool_calls"} <= set(logged)
    assert 0 < float(logged["losses/sft"]) < 20

    grpo_out = tmp_path / "zoom_grpo"
    assert main(["fit", "-c", str(CONFIGS / "zoom_grpo_tiny.yaml"), *_common(tmp_path, "grpo"),
                 f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={grpo_out}",
                 "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=8",
                 "--model.init_args.agent.max_total_tokens=40"]) == 0
    logged = _logged(tmp_path / "grpo")
    assert {"agent/turns_mean", "agent/tool_calls_mean", "losses/policy", "val/accuracy"} <= set(logged)
    records = [json.loads(line) for line in (tmp_path / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and {record["step"] for record in records} == {0, 1}


def test_arpo_two_steps_through_mmpo_fit(tmp_path):
    """configs/agent/arpo_tiny.yaml, 2 steps, from the tiny text LM: branching logged, n trajectories per prompt."""
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
                 "--intermediate-size", "64", "--num-layers", "1"]) == 0
    assert main(["fit", "-c", str(CONFIGS / "arpo_tiny.yaml"), *_common(tmp_path, "arpo"),
                 f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={tmp_path / 'arpo_out'}",
                 "--model.init_args.sampling.num_generations=4", "--model.init_args.arpo.initial_rollouts=2",
                 "--model.init_args.sampling.max_new_tokens=8", "--model.init_args.agent.max_total_tokens=40",
                 "--model.init_args.arpo.attribution=hard"]) == 0
    logged = _logged(tmp_path / "arpo")
    assert {"arpo/forks", "arpo/topups", "arpo/forked_frac", "agent/tool_calls_mean", "losses/policy",
            "val/accuracy"} <= set(logged)
    records = [json.loads(line) for line in (tmp_path / "arpo" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 4  # 2 steps x 2 prompts x n = 4
    for step in (0, 1):
        groups = [r["group"] for r in records if r["step"] == step]
        assert groups == [0, 0, 0, 0, 1, 1, 1, 1]
    checkpoint = torch.load(tmp_path / "arpo" / "ckpt" / "last.ckpt", weights_only=False)
    assert set(checkpoint["arpo_branching"]) == {"rng", "initial_entropy"}


@pytest.mark.parametrize(("task", "prompt"), [("codebook", "What is the code of"),
                                              ("codebook_pair", "Join the codes of")])
def test_codebook_sft_grpo_and_arpo_two_steps_each(tmp_path, task, prompt):
    """configs/agent/{codebook,codebook_pair}_{sft,grpo,arpo}_tiny.yaml, 2 steps each through ``mmpo fit``: SFT on
    the task's traces, then GRPO and ARPO with the sandboxed codebook tool from that start."""
    sft_out = _tiny_base_then_sft(tmp_path, task)
    logged = _logged(tmp_path / "sft")
    assert 0 < float(logged["losses/sft"]) < 20
    for name, extra in (("grpo", []), ("arpo", ["--model.init_args.arpo.initial_rollouts=1"])):
        assert main(["fit", "-c", str(CONFIGS / f"{task}_{name}_tiny.yaml"), *_common(tmp_path, name),
                     f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={tmp_path / name}_out",
                     "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=8",
                     "--model.init_args.agent.max_total_tokens=40", *extra]) == 0
        logged = _logged(tmp_path / name)
        assert {"agent/turns_mean", "agent/tool_calls_mean", "losses/policy", "val/accuracy"} <= set(logged)
        records = [json.loads(line) for line in (tmp_path / name / "rollouts.jsonl").read_text().splitlines()]
        assert len(records) == 2 * 2 * 2 and {record["step"] for record in records} == {0, 1}
        assert all(record["messages"][0]["content"].startswith(prompt) for record in records)
