"""Vector envs split into groups that step independently: pipelined rollout collection (issue 19).

:class:`EnvGroups` holds ``G`` vector envs over contiguous slices of ``num_envs`` envs (group g: envs
``start_g .. start_g + n_g - 1``) and is itself a SAME_STEP vector env over all of them: ``reset(seed=s)``
seeds env i with ``s + i`` exactly as one vector env of ``num_envs`` would, ``step`` steps every group
(all groups' workers run at once, then each group is waited for) and merges the groups' infos into one
info dict in gymnasium's layout (:func:`concat_infos`). What it adds is stepping one group at a time:
``step_group_async(g, actions)`` / ``step_group_wait(g)``, so that while one group's worker processes run
the simulator the caller computes the next group's actions (:meth:`mmpo.robotics.dppo.DPPOModule.collect_rollout`
with ``env_groups > 1``). A group without ``step_async`` (an in-process ``SyncVectorEnv``) steps at its wait.

Dead workers: each group restarts its own (:mod:`mmpo.robotics.envs.workers`); with ``max_worker_restarts`` set,
the groups share one :class:`~mmpo.robotics.envs.workers.RestartBudget`: a group may restart a worker as long as
all groups together have restarted fewer than ``max_worker_restarts`` (the limit one vector env of all envs
would have, with the same error message).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space

from mmpo.robotics.envs.workers import RestartBudget


def group_sizes(num_envs: int, num_groups: int) -> list[int]:
    """Envs per group, as even as possible, larger groups first: (5, 2) -> [3, 2]."""
    if not 1 <= num_groups <= num_envs:
        raise ValueError(f"env groups must be in [1, num_envs={num_envs}], got {num_groups}")
    base, extra = divmod(num_envs, num_groups)
    return [base + (1 if index < extra else 0) for index in range(num_groups)]


def concat_infos(infos: Sequence[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    """Vector infos of consecutive groups (``sizes`` envs each) -> one vector info dict over all envs.

    Each key's array gets each group's rows at its slice; a group without the key gets gymnasium's fill
    (zeros, ``None`` for object arrays) and its ``_key`` mask rows are False, as ``VectorEnv._add_info``
    would have left them. Nested dicts (``final_info``) are merged the same way."""
    total = int(sum(sizes))
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    keys: list[str] = []
    for info in infos:
        keys.extend(key for key in info if key not in keys)
    merged: dict[str, Any] = {}
    for key in keys:
        present = [(index, info[key]) for index, info in enumerate(infos) if key in info]
        if any(isinstance(value, dict) for _, value in present):
            merged[key] = concat_infos([info.get(key, {}) for info in infos], sizes)
            continue
        template = np.asarray(present[0][1])
        if template.dtype == object:
            array = np.full((total, *template.shape[1:]), None, dtype=object)
        else:
            array = np.zeros((total, *template.shape[1:]), dtype=template.dtype)
        for index, value in present:
            array[starts[index]:starts[index + 1]] = value
        merged[key] = array
    return merged


def _concat_obs(parts: Sequence[Any]) -> Any:
    if isinstance(parts[0], dict):
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return np.concatenate(parts)


class EnvGroups(gym.vector.VectorEnv):
    """``G`` vector envs as one vector env over all their envs, each group also stepped on its own.

    Args:
        groups: the vector envs, in env order (group g's env j is env ``start_g + j``); SAME_STEP autoreset.
        max_worker_restarts: the restart budget shared by all groups (None: each group keeps its own limit).
    """

    def __init__(self, groups: Sequence[gym.vector.VectorEnv], *, max_worker_restarts: int | None = None) -> None:
        if not groups:
            raise ValueError("EnvGroups needs at least one group")
        self.groups = list(groups)
        self.sizes = [int(group.num_envs) for group in self.groups]
        self.starts = [int(start) for start in np.concatenate([[0], np.cumsum(self.sizes)[:-1]])]
        self.slices = [slice(start, start + size) for start, size in zip(self.starts, self.sizes)]
        self.num_envs = int(sum(self.sizes))
        first = self.groups[0]
        self.single_observation_space = first.single_observation_space
        self.single_action_space = first.single_action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = dict(first.metadata)
        self.render_mode = getattr(first, "render_mode", None)
        if max_worker_restarts is not None:
            budget = RestartBudget(max_worker_restarts)
            for group in self.groups:
                if hasattr(group, "restart_budget"):
                    group.restart_budget = budget
        self._pending_actions: list[Any] = [None] * len(self.groups)
        self._pending_resets: list[tuple[Any, Any]] = []
        self.closed = False

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def worker_restarts(self) -> int:
        return int(sum(getattr(group, "worker_restarts", 0) for group in self.groups))

    # ------------------------------------------------------------------ one group
    def step_group_async(self, index: int, actions: Any) -> None:
        """Send group ``index`` its actions (rows ``slices[index]`` of a full batch) and return at once."""
        group = self.groups[index]
        if hasattr(group, "step_async"):
            group.step_async(actions)
        else:
            self._pending_actions[index] = actions

    def step_group_wait(self, index: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Group ``index``'s step result (its envs only), as its vector env returns it."""
        group = self.groups[index]
        if hasattr(group, "step_wait"):
            return group.step_wait()
        actions, self._pending_actions[index] = self._pending_actions[index], None
        return group.step(actions)

    def merge_steps(self, results: Sequence[tuple[Any, ...]]) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Every group's step result, in group order -> the step result over all envs."""
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (_concat_obs(obs), np.concatenate(rewards), np.concatenate(terminated), np.concatenate(truncated),
                concat_infos(infos, self.sizes))

    # ------------------------------------------------------------------ VectorEnv API over all envs
    def reset_async(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Send every group its reset (env i seeded ``seed + i``); a group without ``reset_async`` resets at the wait."""
        seeds: list[Any]
        if seed is None or isinstance(seed, (int, np.integer)):
            seeds = [None if seed is None else int(seed) + start for start in self.starts]
        else:
            seeds = [list(seed)[part] for part in self.slices]
        self._pending_resets = []
        for group, group_seed in zip(self.groups, seeds):
            if hasattr(group, "reset_async"):
                group.reset_async(seed=group_seed, options=options)
            self._pending_resets.append((group_seed, options))

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        results = []
        for group, (group_seed, options) in zip(self.groups, self._pending_resets):
            if hasattr(group, "reset_wait"):
                results.append(group.reset_wait())
            else:
                results.append(group.reset(seed=group_seed, options=options))
        obs, infos = zip(*results)
        return _concat_obs(obs), concat_infos(infos, self.sizes)

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def step(self, actions: Any):
        for index, part in enumerate(self.slices):
            self.step_group_async(index, actions[part])
        return self.merge_steps([self.step_group_wait(index) for index in range(self.num_groups)])

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return tuple(value for group in self.groups for value in group.get_attr(name))

    def set_attr(self, name: str, values: Any) -> None:
        """``values``: one per env (a list of num_envs, split by group) or one for all envs."""
        if isinstance(values, (list, tuple)):
            if len(values) != self.num_envs:
                raise ValueError(f"set_attr({name!r}) needs {self.num_envs} values, got {len(values)}")
            for group, part in zip(self.groups, self.slices):
                group.set_attr(name, list(values[part]))
        else:
            for group in self.groups:
                group.set_attr(name, values)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return tuple(value for group in self.groups for value in group.call(name, *args, **kwargs))

    def close(self, **kwargs: Any) -> None:
        if self.closed:
            return
        for group in self.groups:
            group.close(**kwargs)
        self.closed = True
