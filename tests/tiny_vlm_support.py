"""A very small tiny VLM for module-level tests (shared by name: tests/ is on sys.path, see conftest.py)."""

from __future__ import annotations

from pathlib import Path


def build_small_vlm(directory: Path, *, hidden_size: int = 32, intermediate_size: int = 64) -> str:
    """``build_tiny_vlm`` with a 300-token vocabulary trained on one prompt/solution pair; returns its path."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> 0123456789"] * 10
    return str(build_tiny_vlm(directory, corpus=corpus, vocab_size=300, hidden_size=hidden_size,
                              intermediate_size=intermediate_size))


def tiny_grpo_fit_args(config: Path, tiny_path: str, tmp_path: Path, *overrides: str) -> list[str]:
    """``mmpo fit`` arguments for 2 GRPO steps of ``config`` on a tiny VLM under ``tmp_path``: G = 2, 4 new
    tokens, 4 training rows of two tasks, 2 prompts a batch, no validation (``overrides`` go in between)."""
    return [
        "fit", "-c", str(config),
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--model.init_args.model_path={tiny_path}", f"--model.init_args.output_dir={tmp_path / 'hf'}",
        "--model.init_args.num_generations=2", "--model.init_args.max_new_tokens=4",
        *overrides,
        "--data.init_args.tasks=[count_shapes,arithmetic]", "--data.init_args.train_size=4",
        "--data.init_args.val_size=2", "--data.init_args.batch_size=2",
    ]
