"""Reward functions for VLM reasoning: a registry, built-ins and a safe weighted sum.

``fn(completions: list[str], rows: list[Row]) -> Tensor (N,) float32``; register new
ones with ``@register_reward(name)``. Built-ins: ``accuracy``, ``format``, ``length``.
A user's own function is named by ``path/to/file.py:fn`` or ``package.module:fn`` and keeps
TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]`` (``mmpo.rewards.user``).
With a deadline, ``compute_rewards`` runs them in a worker process (``mmpo.rewards.worker``).

Importing this package loads no torch: the reward worker imports it, and runs the built-ins
without torch. ``compute_rewards`` and ``DEFAULT_REWARD_WEIGHTS`` (``mmpo.rewards.compute``, which
needs torch) load on first access.
"""

from typing import Any

from mmpo.rewards.registry import REWARDS, RewardFn, get_reward, register_reward
from mmpo.rewards import builtin  # noqa: F401  (registers the built-in rewards)
from mmpo.rewards.answers import answers_match, extract_answer
from mmpo.rewards.builtin import accuracy_reward, format_reward, is_think_answer_format, length_reward
from mmpo.rewards.user import RewardSpecError, UserReward, resolve_reward, validate_reward_weights
from mmpo.rewards.worker import shutdown_reward_worker

_FROM_COMPUTE = ("DEFAULT_REWARD_WEIGHTS", "compute_rewards")
"""Names of ``mmpo.rewards.compute`` (torch) given on first access, so the worker's import stays torch-free."""


def __getattr__(name: str) -> Any:
    if name in _FROM_COMPUTE:
        from mmpo.rewards import compute

        return getattr(compute, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_REWARD_WEIGHTS",
    "REWARDS",
    "RewardFn",
    "RewardSpecError",
    "UserReward",
    "accuracy_reward",
    "answers_match",
    "compute_rewards",
    "extract_answer",
    "format_reward",
    "get_reward",
    "is_think_answer_format",
    "length_reward",
    "register_reward",
    "resolve_reward",
    "shutdown_reward_worker",
    "validate_reward_weights",
]
