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
        "--model.init_args.max_new_tokens=6", "--trainer.max_steps=2", f"--trainer.default_root_dir={root}",
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
