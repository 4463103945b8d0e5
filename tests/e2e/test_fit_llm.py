"""The tiny text-LM path end to end through the CLI: `mmpo build-tiny --kind text`, then 2 steps each of
configs/llm/sft_tiny.yaml (which writes the weights the next two read), grpo_tiny.yaml and dpo_tiny.yaml."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from mmpo.cli import main
from mmpo.vlm.factory import TextProcessor, load_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "llm"


def _common(tmp_path: Path, name: str) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path / name}",
        f"--trainer.logger.init_args.save_dir={tmp_path / name}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / name / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=2",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.tasks=[long_arithmetic,word_problem,countdown]",
        "--data.init_args.train_size=6",
        "--data.init_args.val_size=2",
        "--data.init_args.batch_size=2",
    ]


def _logged(log_dir: Path) -> set[str]:
    (path,) = log_dir.glob("**/metrics.csv")
    return {key for row in csv.DictReader(path.open()) for key, value in row.items() if value}


def test_build_tiny_text_then_sft_grpo_dpo_through_the_cli(tmp_path):
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
                 "--intermediate-size", "64", "--num-layers", "1"]) == 0
    model, processor = load_vlm(base)
    assert type(model).__name__ == "Qwen3ForCausalLM" and isinstance(processor, TextProcessor)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32

    sft_out = tmp_path / "text_sft"
    assert main(["fit", "-c", str(CONFIGS / "sft_tiny.yaml"), *_common(tmp_path, "sft"),
                 f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={sft_out}",
                 "--model.init_args.val_max_new_tokens=4"]) == 0
    trained, _ = load_vlm(sft_out)
    assert type(trained).__name__ == "Qwen3ForCausalLM"
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters()))
    assert {"losses/sft", "val/accuracy"} <= _logged(tmp_path / "sft")

    grpo_out = tmp_path / "text_grpo"
    assert main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), *_common(tmp_path, "grpo"),
                 f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={grpo_out}",
                 "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
                 "--model.init_args.loss.beta=0.01"]) == 0
    assert type(load_vlm(grpo_out)[0]).__name__ == "Qwen3ForCausalLM"
    logged = _logged(tmp_path / "grpo")
    for key in ("losses/policy", "losses/kl", "policy/clipfrac", "rewards/accuracy/mean", "rewards/total/mean",
                "response/length_mean", "val/accuracy"):
        assert key in logged, key
    last = tmp_path / "grpo" / "ckpt" / "last.ckpt"
    assert last.is_file()
    # resume: one more step from the step-2 checkpoint
    assert main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), *_common(tmp_path, "grpo"), "--trainer.max_steps=3",
                 f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={grpo_out}",
                 "--model.init_args.overwrite_output=true",
                 "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
                 "--model.init_args.loss.beta=0.01", f"--ckpt_path={last}"]) == 0
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 3

    dpo_out = tmp_path / "text_dpo"
    assert main(["fit", "-c", str(CONFIGS / "dpo_tiny.yaml"), *_common(tmp_path, "dpo"),
                 f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={dpo_out}",
                 "--model.init_args.val_max_new_tokens=4", "--model.init_args.ref_batch_size=2"]) == 0
    assert type(load_vlm(dpo_out)[0]).__name__ == "Qwen3ForCausalLM"
    assert any(key.startswith("losses/") for key in _logged(tmp_path / "dpo"))
