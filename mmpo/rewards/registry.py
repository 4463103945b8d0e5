"""Reward function registry.

A reward function has the signature
``fn(completions: list[str], rows: list[Row]) -> torch.Tensor`` of shape (N,) float32
(or a list of N floats), where ``rows[i]`` is the dataset row completion ``i`` answers (rows
repeat per sample).

Imports no torch: the reward worker process (``mmpo.rewards.worker``) imports this module, and a
worker that runs only torch-free rewards never loads torch (about 525 MiB of resident memory).
A registered function may name a ``worker_form`` (:func:`register_reward`): the same reward as a
torch-free function returning a list of floats, which the worker runs in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RewardFn = Callable[[list[str], list[dict[str, Any]]], "torch.Tensor | list[float | None]"]  # noqa: F821

REWARDS: dict[str, RewardFn] = {}
"""Registered reward functions by name."""

WORKER_FORM = "worker_form"
"""The attribute of a reward function holding its torch-free form (see :func:`register_reward`)."""


def register_reward(name: str, *, worker_form: Callable[[list[str], list[dict[str, Any]]], list[float]] | None = None
                    ) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``; duplicates fail loudly.

    ``worker_form``: the same reward as a module-level function with the same arguments that returns
    the same values as a list of floats and imports no torch; the reward worker runs it instead of the
    decorated function (:func:`worker_form_of`), so a worker running only such rewards never loads torch.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered; registered: {sorted(REWARDS)}")
        if worker_form is not None:
            setattr(fn, WORKER_FORM, worker_form)
        REWARDS[name] = fn
        return fn

    return decorator


def worker_form_of(fn: RewardFn) -> RewardFn:
    """What the reward worker runs for ``fn``: its torch-free ``worker_form`` if it has one, else ``fn``."""
    return getattr(fn, WORKER_FORM, None) or fn


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``; an unknown name lists the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}") from None
