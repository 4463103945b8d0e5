"""Reward functions for VLM reasoning: a registry, built-ins and a safe weighted sum.

``fn(completions: list[str], rows: list[Row]) -> Tensor (N,) float32``; register new
ones with ``@register_reward(name)``. Built-ins: ``accuracy``, ``format``, ``length``.
A user's own function is named by ``path/to/file.py:fn`` or ``package.module:fn`` and keeps
TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]`` (``mmpo.rewards.user``).
With a deadline, ``compute_rewards`` runs them in a worker process (``mmpo.rewards.worker``).
"""

from mmpo.rewards.registry import REWARDS, RewardFn, get_reward, register_reward
from mmpo.rewards import builtin  # noqa: F401  (registers the built-in rewards)
from mmpo.rewards.answers import answers_match, extract_answer
from mmpo.rewards.builtin import accuracy_reward, format_reward, is_think_answer_format, length_reward
from mmpo.rewards.compute import DEFAULT_REWARD_WEIGHTS, compute_rewards
from mmpo.rewards.user import RewardSpecError, UserReward, resolve_reward, validate_reward_weights
from mmpo.rewards.worker import shutdown_reward_worker

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
