"""Reward function registry.

A reward function has the signature
``fn(completions: list[str], rows: list[Row]) -> torch.Tensor`` of shape (N,) float32,
where ``rows[i]`` is the dataset row completion ``i`` answers (rows repeat per sample).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

RewardFn = Callable[[list[str], list[dict[str, Any]]], torch.Tensor]

REWARDS: dict[str, RewardFn] = {}
"""Registered reward functions by name."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``; duplicates fail loudly."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered; registered: {sorted(REWARDS)}")
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``; an unknown name lists the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}") from None
