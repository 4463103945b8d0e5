"""Vectorised chunk envs in subprocesses (gymnasium's vector API) and a throughput probe.

Each worker builds ``ActionChunkWrapper(make_env(task, seed=seed + i), act_steps,
normalizer)`` itself (the normaliser is loaded from its JSON inside the worker), so a
chunk step costs one pipe round trip per ``act_steps`` simulator steps.

Autoreset: ``AutoresetMode.SAME_STEP``. When env i's episode ends inside a step, that
same step returns env i's *reset* observation; the episode's last observation is in
``infos["final_obs"][i]`` and its info (``success``, ``fault``, ...) in
``infos["final_info"][key][i]`` (mask ``infos["_final_info"]``). This matches DPPO's
``reset_within_step=True`` and keeps the next chunk step valid for every env.
:func:`merged_info` reads a key taking the final info where an episode ended.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from mmpo.robotics.envs.chunking import ActionChunkWrapper
from mmpo.robotics.envs.make import make_env
from mmpo.robotics.envs.normalizer import Normalizer
from mmpo.robotics.envs.workers import RestartingAsyncVectorEnv

#: thread pools each worker would otherwise open; workers inherit these at start.
_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _build_chunk_env(
    task: str,
    seed: int,
    act_steps: int,
    normalizer_path: str | None,
    max_episode_steps: int | None,
    terminate_on_success: bool,
) -> gym.Env:
    """Worker-side env factory (module level so it pickles for forkserver/spawn)."""
    normalizer = Normalizer.load(normalizer_path) if normalizer_path is not None else None
    env = make_env(task, seed=seed, max_episode_steps=max_episode_steps, terminate_on_success=terminate_on_success)
    return ActionChunkWrapper(env, act_steps=act_steps, normalizer=normalizer)


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in _SINGLE_THREAD_ENV}
    os.environ.update(_SINGLE_THREAD_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _preload_forkserver(task: str) -> None:
    """Import the simulator once in the forkserver so each forked worker skips it.

    Without this every worker re-imports robosuite (seconds each on a loaded machine).
    Only effective before the forkserver process starts (the first vector env).
    """
    from mmpo.robotics.envs.tasks import get_task

    modules = ["mmpo.robotics.envs.vector"]
    if get_task(task).family == "robosuite":
        modules += ["robosuite", "mmpo.robotics.envs.robosuite_env"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(modules)


def default_context() -> str:
    """"forkserver" on Linux (a clean server process: no inherited torch/GL state), else "spawn"."""
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


def make_vector_env(
    task: str,
    num_envs: int,
    *,
    seed: int,
    act_steps: int,
    normalizer_path: str | Path | None = None,
    max_episode_steps: int | None = None,
    asynchronous: bool = True,
    terminate_on_success: bool = False,
    context: str | None = None,
    max_worker_restarts: int = 3,
) -> gym.vector.VectorEnv:
    """``num_envs`` chunk envs; env i is seeded with ``seed + i``.

    Args:
        task: "lift", "can", "square" or "hopper".
        num_envs: number of parallel envs (one subprocess each when ``asynchronous``).
        seed: base seed.
        act_steps: simulator steps per chunk step.
        normalizer_path: stats JSON (``<dataset>.stats.json``); ``None`` = raw obs/actions.
        max_episode_steps: time limit in simulator steps (task default if None).
        asynchronous: subprocess ``AsyncVectorEnv`` (True) or in-process ``SyncVectorEnv``.
        terminate_on_success: see :func:`mmpo.robotics.envs.make_env`.
        context: multiprocessing start method (default :func:`default_context`).
        max_worker_restarts: dead worker processes restarted before an ``EnvWorkerError`` (see
            :mod:`mmpo.robotics.envs.workers`; the count is ``vec.worker_restarts``).

    Returns:
        VectorEnv with ``single_action_space`` (act_steps, action_dim) and autoreset mode
        SAME_STEP (see module docstring). ``vec.get_attr("fault_count")`` lists each
        worker's simulator-fault count.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if normalizer_path is not None and not Path(normalizer_path).exists():
        raise FileNotFoundError(f"normaliser stats not found: {normalizer_path}")
    env_fns = [
        functools.partial(
            _build_chunk_env,
            task,
            int(seed) + index,
            int(act_steps),
            None if normalizer_path is None else str(normalizer_path),
            max_episode_steps,
            bool(terminate_on_success),
        )
        for index in range(num_envs)
    ]
    if not asynchronous:
        return SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)
    context = context or default_context()
    with _single_threaded_children():
        if context == "forkserver":
            _preload_forkserver(task)
        names = [f"{task}, seed {int(seed) + index}" for index in range(num_envs)]
        return RestartingAsyncVectorEnv(env_fns, context=context, autoreset_mode=AutoresetMode.SAME_STEP,
                                        max_restarts=max_worker_restarts, env_names=names)


def merged_info(infos: dict[str, Any], key: str, default: Any = False) -> np.ndarray:
    """Per-env value of ``key`` after a SAME_STEP vector step: the finished episode's value
    (``final_info``) where an episode ended, the current one elsewhere. Shape (num_envs,)."""
    final_mask = infos.get("_final_info")
    if key in infos:
        out = np.array(infos[key])
    elif final_mask is not None:
        out = np.full(len(final_mask), default)
    else:
        raise KeyError(f"info key {key!r} not present (keys: {sorted(infos)})")
    final = infos.get("final_info", {})
    if final_mask is not None and key in final:
        out = np.where(np.asarray(final_mask, dtype=bool), np.asarray(final[key]), out)
    return out


def measure_steps_per_s(
    task: str,
    num_envs: int,
    steps: int,
    *,
    act_steps: int = 4,
    seed: int = 0,
    max_episode_steps: int | None = None,
) -> dict[str, float]:
    """Simulator steps per second: one raw env vs the subprocess vector env, same run.

    Both use random actions; construction and the first reset are excluded. ``steps`` is
    the number of simulator steps per env (rounded up to whole chunks for the vector env).

    Returns:
        dict with ``raw_steps_per_s``, ``vector_steps_per_s`` (env steps summed over envs),
        ``speedup`` (vector / raw), ``raw_cpu_s_per_step`` (process CPU time per raw step,
        independent of machine load), ``num_envs``, ``act_steps``, ``steps``.
    """
    raw_env = make_env(task, seed=seed, max_episode_steps=max_episode_steps)
    rng = np.random.default_rng(seed)
    raw_env.reset()
    low, high = raw_env.action_space.low, raw_env.action_space.high
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _, _, terminated, truncated, _ = raw_env.step(rng.uniform(low, high))
        if terminated or truncated:
            raw_env.reset()
    raw_seconds = time.perf_counter() - start
    raw_cpu_seconds = time.process_time() - cpu_start
    raw_env.close()

    vector_env = make_vector_env(
        task, num_envs, seed=seed, act_steps=act_steps, max_episode_steps=max_episode_steps
    )
    try:
        vector_env.reset(seed=seed)
        chunk_steps = -(-steps // act_steps)
        start = time.perf_counter()
        for _ in range(chunk_steps):
            vector_env.step(vector_env.action_space.sample())
        vector_seconds = time.perf_counter() - start
    finally:
        vector_env.close()
    raw_rate = steps / raw_seconds
    vector_rate = num_envs * chunk_steps * act_steps / vector_seconds
    return {
        "raw_steps_per_s": raw_rate,
        "vector_steps_per_s": vector_rate,
        "speedup": vector_rate / raw_rate,
        # CPU seconds per raw step: shows how far wall-clock rates are from an idle core
        "raw_cpu_s_per_step": raw_cpu_seconds / steps,
        "num_envs": float(num_envs),
        "act_steps": float(act_steps),
        "steps": float(steps),
    }
