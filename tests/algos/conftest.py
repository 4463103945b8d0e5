"""Shared helpers of the algorithm tests."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vlm"


def _fit(config: str, model: Path, root: Path, *overrides: str) -> list[dict[str, str]]:
    """Run `mmpo fit -c configs/vlm/<config>` in-process for 2 steps; return the CSV-logged metric rows."""
    from mmpo.cli import main

    main([
        "fit", "-c", str(CONFIGS / config),
        f"--model.init_args.model_path={model}", "--model.init_args.output_dir=null",
        "--model.init_args.sampling.max_new_tokens=6", "--trainer.max_steps=2", f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false", "--data.init_args.train_size=8", "--trainer.max_epochs=1", *overrides,
    ])
    with open(next(Path(root).rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f))


@pytest.fixture
def fit_vlm_config() -> Callable[..., list[dict[str, str]]]:
    """``fit_vlm_config(config_name, model_path, root, *overrides) -> metric rows``."""
    return _fit


def _fit_preference(config: str, model: str, root: Path, *overrides: str) -> list[dict[str, str]]:
    """`mmpo fit -c configs/vlm/<config>` in-process for 2 steps on 8 rows, no checkpoints (the
    preference modules have no shared max_new_tokens to override); the CSV-logged metric rows."""
    from mmpo.cli import main

    main(["fit", "-c", str(CONFIGS / config), f"--model.init_args.model_path={model}",
          "--model.init_args.output_dir=null", "--trainer.max_steps=2", f"--trainer.default_root_dir={root}",
          f"--trainer.logger.init_args.save_dir={root}", "--trainer.enable_progress_bar=false",
          "--data.init_args.train_size=8", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
          *overrides])
    with open(next(Path(root).rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f))


@pytest.fixture
def fit_preference_config() -> Callable[..., list[dict[str, str]]]:
    """``fit_preference_config(config_name, model_path, root, *overrides) -> metric rows``."""
    return _fit_preference


SCRIPTED_REWARD = "scripted"


@pytest.fixture
def scripted_reward(monkeypatch) -> Callable[[list[float]], dict[str, float]]:
    """``scripted_reward(pattern) -> reward_weights``: registers a reward that ignores the text and
    gives completion i of each batch ``pattern[i % len(pattern)]``, so the rewards of a sampled
    smoke run (and every value derived from them) are known in advance."""
    import torch

    from mmpo.rewards.registry import REWARDS

    def install(pattern: list[float]) -> dict[str, float]:
        def scripted(completions, rows):
            return torch.tensor([pattern[i % len(pattern)] for i in range(len(completions))], dtype=torch.float32)

        monkeypatch.setitem(REWARDS, SCRIPTED_REWARD, scripted)
        return {SCRIPTED_REWARD: 1.0}

    return install


def _hand_grpo_advantages(rewards, group_size: int, eps: float = 1e-6):
    """(r - group mean) / (unbiased group std + eps) for contiguous groups, written out
    independently of mmpo.core so tests can check the modules against it."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    std = (centred.pow(2).sum(-1, keepdim=True) / (group_size - 1)).sqrt()
    return (centred / (std + eps)).flatten()


@pytest.fixture
def hand_grpo_advantages() -> Callable:
    """``hand_grpo_advantages(rewards (N,), group_size, eps=1e-6) -> (N,)``."""
    return _hand_grpo_advantages


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen-VL whose vocabulary covers count_shapes prompts and the answer format (the variant tests)."""
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("variant_model"), corpus=corpus)
@pytest.fixture(scope="session")
def variant_tiny_vlm(tmp_path_factory) -> Path:
    """A very small Qwen2.5-VL (hidden 32) whose tokenizer knows the system prompt and the answer format,
    shared by the issue-16 variant module tests (tests/algos/test_variant_*.py)."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3</think><answer>3</answer> 0123456789",
              *[r["expert_trace"] for r in make_items("count_shapes", 10, seed=0)]] * 2
    return build_tiny_vlm(tmp_path_factory.mktemp("variant_vlm"), corpus=corpus, vocab_size=300, hidden_size=32,
                          intermediate_size=64)


@pytest.fixture
def cpu_trainer() -> Callable:
    """``cpu_trainer(max_steps) -> lightning.Trainer`` without logger, checkpoints or progress bar."""
    import lightning as L

    def make(max_steps: int) -> "L.Trainer":
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_steps=max_steps)

    return make


@pytest.fixture
def fit_variant(fit_vlm_config, variant_tiny_vlm, tmp_path) -> Callable[..., list[dict[str, str]]]:
    """``fit_variant(name, *overrides) -> metric rows``: 2 steps of ``configs/vlm/variants/<name>_tiny.yaml`` on
    the tiny VLM, 2 prompts a batch, no validation, checkpoints under ``tmp_path`` (later overrides win)."""

    def run(name: str, *overrides: str) -> list[dict[str, str]]:
        return fit_vlm_config(f"variants/{name}_tiny.yaml", variant_tiny_vlm, tmp_path,
                              f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
                              "--trainer.limit_val_batches=0", "--data.init_args.batch_size=2", *overrides)

    return run
