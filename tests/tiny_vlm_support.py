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


def tiny_qwen3_vl_config():
    """A tiny random Qwen3-VL's config (mmpo builds no tiny Qwen3-VL processor): 2 text layers of width 32,
    a 2-block vision tower whose deepstack features feed both layers; image / video / vision start / end
    token ids 60 / 61 / 62 / 63 in a 64-token vocabulary."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)


def tiny_grpo_fit_args(config: Path, tiny_path: str, tmp_path: Path, *overrides: str,
                       tasks: tuple[str, ...] = ("count_shapes", "arithmetic")) -> list[str]:
    """``mmpo fit`` arguments for 2 GRPO steps of ``config`` on a tiny VLM (or, with text ``tasks``, a tiny text
    LM) under ``tmp_path``: G = 2, 4 new tokens, 4 training rows of ``tasks``, 2 prompts a batch, no validation
    (``overrides`` go in between)."""
    return [
        "fit", "-c", str(config),
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--model.init_args.model_path={tiny_path}", f"--model.init_args.output_dir={tmp_path / 'hf'}",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
        *overrides,
        f"--data.init_args.tasks=[{','.join(tasks)}]", "--data.init_args.train_size=4",
        "--data.init_args.val_size=2", "--data.init_args.batch_size=2",
    ]


TEXT_TEST_TASKS = ["long_arithmetic", "word_problem", "countdown"]


def build_small_text_lm(directory: Path, *, hidden_size: int = 32, intermediate_size: int = 64,
                        num_layers: int = 2) -> str:
    """``build_tiny_text_lm`` (a tiny Qwen3) with a 400-token vocabulary trained on the text tasks' corpus
    (20 items per task and split); returns its path."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_text_lm

    texts = [SYSTEM_PROMPT, *corpus(TEXT_TEST_TASKS, n=20)]
    return str(build_tiny_text_lm(directory, corpus=texts, vocab_size=400, hidden_size=hidden_size,
                                  intermediate_size=intermediate_size, num_layers=num_layers))
