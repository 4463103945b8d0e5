"""Execute action chunks: the env step of DPPO's outer MDP (arXiv 2409.00588, Sec. 4.1).

Mirrors DPPO's ``MultiStep`` wrapper (``env/gym_utils/wrapper/multi_step.py``): the policy
predicts a chunk of Ta actions, the first ``act_steps`` are executed one by one, rewards
are summed, and execution stops early when the episode ends. Observations come back
normalised and actions are un-normalised, so the policy lives entirely in [-1, 1].
Resetting at episode end is left to the caller or to gymnasium's vector autoreset.

Skipping a discarded autoreset: a rollout that resets every env at its start (DPPO's robomimic setting)
throws away the reset observation of an env whose episode ends on the rollout's last chunk step, but
gymnasium's SAME_STEP autoreset has already paid for it (a robosuite hard reset rebuilds the model: ~0.1 s,
as long as ~30 simulator steps). ``reset(options={SKIP_AUTORESET_AFTER: n})`` arms the wrapper: the unseeded
``reset()`` that follows an episode end on the n-th chunk step after this reset returns the episode's last
observation instead (info ``reset_skipped``) and the env refuses to step until it is reset again.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from mmpo.robotics.envs.faults import find_fault_wrapper
from mmpo.robotics.envs.normalizer import Normalizer

#: reset option: chunk steps after which an episode end's autoreset is skipped (see the module docstring)
SKIP_AUTORESET_AFTER = "skip_autoreset_after_chunk_steps"


class ActionChunkWrapper(gym.Wrapper):
    """Step with a chunk (act_steps, action_dim) of normalised actions.

    Args:
        env: a single env from :func:`mmpo.robotics.envs.make_env` (its fault guard is found and
            its counter exposed as :attr:`fault_count`).
        act_steps: actions executed per chunk step.
        normalizer: maps obs to [-1, 1] and chunk actions back to env units; ``None`` =
            identity (the chunk is then in env units).

    ``step(chunk)`` takes (>= act_steps, action_dim) — a longer predicted chunk (Ta >
    act_steps) is accepted and only its first ``act_steps`` rows run — and returns
    ``(obs, summed_reward, terminated, truncated, info)`` with info keys ``success``
    (at the last executed step), ``success_any`` (any executed step), ``executed_steps``,
    ``fault`` (a simulator fault ended the episode) and ``fault_count``. ``skipped_resets`` counts the
    autoresets skipped under the :data:`SKIP_AUTORESET_AFTER` reset option.
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
        self._skip_after: int | None = None  # armed by the SKIP_AUTORESET_AFTER reset option
        self._chunk_steps = 0  # chunk steps since the armed reset (autoresets in between do not restart it)
        self._last_obs: Any = None
        self._needs_reset = False  # an autoreset was skipped: stepping now would continue a finished episode
        self.skipped_resets = 0

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
        explicit = seed is not None or options is not None  # gymnasium's autoreset passes neither
        if not explicit and self._skip_after is not None and self._chunk_steps == self._skip_after:
            self._skip_after = None
            self._needs_reset = True
            self.skipped_resets += 1
            return self._last_obs, {"reset_skipped": True, "fault_count": self.fault_count}
        if explicit:
            options = dict(options or {})
            skip_after = options.pop(SKIP_AUTORESET_AFTER, None)
            if skip_after is not None and int(skip_after) < 1:
                raise ValueError(f"{SKIP_AUTORESET_AFTER} must be >= 1 chunk steps, got {skip_after}")
            self._skip_after = None if skip_after is None else int(skip_after)
            self._chunk_steps = 0
            options = options or None
        obs, info = self.env.reset(seed=seed, options=options)
        self._needs_reset = False
        info = dict(info)
        info["fault_count"] = self.fault_count
        return self._obs(obs), info

    def step(self, chunk):
        if self._needs_reset:
            raise RuntimeError("this episode ended and its autoreset was skipped (reset option "
                               f"{SKIP_AUTORESET_AFTER!r}): reset() the env before stepping it")
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
        obs = self._obs(obs)
        if self._skip_after is not None:
            self._chunk_steps += 1
            self._last_obs = obs
        return obs, total_reward, bool(terminated), bool(truncated), info
