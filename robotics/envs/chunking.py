"""Execute action chunks: the env step of DPPO's outer MDP (arXiv 2409.00588, Sec. 4.1).

Mirrors DPPO's ``MultiStep`` wrapper (``env/gym_utils/wrapper/multi_step.py``): the policy
predicts a chunk of Ta actions, the first ``act_steps`` are executed one by one, rewards
are summed, and execution stops early when the episode ends. Observations come back
normalised and actions are un-normalised, so the policy lives entirely in [-1, 1].
Resetting at episode end is left to the caller or to gymnasium's vector autoreset.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from robotics.envs.faults import find_fault_wrapper
from robotics.envs.normalizer import Normalizer


class ActionChunkWrapper(gym.Wrapper):
    """Step with a chunk (act_steps, action_dim) of normalised actions.

    Args:
        env: a single env from :func:`robotics.envs.make_env` (its fault guard is found and
            its counter exposed as :attr:`fault_count`).
        act_steps: actions executed per chunk step.
        normalizer: maps obs to [-1, 1] and chunk actions back to env units; ``None`` =
            identity (the chunk is then in env units).

    ``step(chunk)`` takes (>= act_steps, action_dim) — a longer predicted chunk (Ta >
    act_steps) is accepted and only its first ``act_steps`` rows run — and returns
    ``(obs, summed_reward, terminated, truncated, info)`` with info keys ``success``
    (at the last executed step), ``success_any`` (any executed step), ``executed_steps``,
    ``fault`` (a simulator fault ended the episode) and ``fault_count``.
    """

    def __init__(self, env: gym.Env, act_steps: int, normalizer: Normalizer | None = None) -> None:
        super().__init__(env)
        if act_steps < 1:
            raise ValueError(f"act_steps must be >= 1, got {act_steps}")
        self.act_steps = int(act_steps)
        self.normalizer = normalizer
        self._fault_guard = find_fault_wrapper(env)
        inner = env.action_space
        action_dim = int(inner.shape[0])
        if normalizer is not None:
            if normalizer.action_dim != action_dim:
                raise ValueError(f"normaliser action_dim {normalizer.action_dim} != env action_dim {action_dim}")
            low = -np.ones((self.act_steps, action_dim), dtype=np.float32)
            high = np.ones((self.act_steps, action_dim), dtype=np.float32)
        else:
            low = np.tile(inner.low, (self.act_steps, 1)).astype(np.float32)
            high = np.tile(inner.high, (self.act_steps, 1)).astype(np.float32)
        self.action_space = gym.spaces.Box(low, high, dtype=np.float32)
        self.observation_space = self._normalised_space(env.observation_space)

    def _normalised_space(self, space: gym.Space) -> gym.Space:
        if self.normalizer is None:
            return space
        if isinstance(space, gym.spaces.Dict):
            spaces = dict(space.spaces)
            spaces["state"] = gym.spaces.Box(-np.inf, np.inf, shape=space["state"].shape, dtype=np.float32)
            return gym.spaces.Dict(spaces)
        return gym.spaces.Box(-np.inf, np.inf, shape=space.shape, dtype=np.float32)

    @property
    def fault_count(self) -> int:
        return 0 if self._fault_guard is None else self._fault_guard.fault_count

    def _obs(self, obs):
        if self.normalizer is None:
            return obs
        if isinstance(obs, dict):
            obs = dict(obs)
            obs["state"] = self.normalizer.normalize_obs(obs["state"]).astype(np.float32)
            return obs
        return self.normalizer.normalize_obs(np.asarray(obs)).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        info = dict(info)
        info["fault_count"] = self.fault_count
        return self._obs(obs), info

    def step(self, chunk):
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[0] < self.act_steps or chunk.shape[1] != self.action_space.shape[1]:
            raise ValueError(
                f"action chunk must have shape (>= {self.act_steps}, {self.action_space.shape[1]}), got {chunk.shape}"
            )
        actions = chunk[: self.act_steps]
        if self.normalizer is not None:
            actions = self.normalizer.unnormalize_action(actions)
        total_reward = 0.0
        success_any = False
        terminated = truncated = False
        info: dict[str, Any] = {}
        executed = 0
        for action in actions:
            obs, reward, terminated, truncated, info = self.env.step(action)
            executed += 1
            total_reward += float(reward)
            success_any = success_any or bool(info.get("success", False))
            if terminated or truncated:
                break
        info = dict(info)
        info["success_any"] = success_any
        info["success"] = bool(info.get("success", False))
        info["fault"] = bool(info.get("fault", False))
        info["executed_steps"] = executed
        info["fault_count"] = self.fault_count
        return self._obs(obs), total_reward, bool(terminated), bool(truncated), info
