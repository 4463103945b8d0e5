"""Subprocess vector envs that survive a dead worker: restart it (counted, up to a limit), then fail clearly.

gymnasium's ``AsyncVectorEnv`` ends the run with a bare ``EOFError`` (or ``BrokenPipeError``) when a
worker process dies (OOM killer, a segfault in the simulator, a stray ``kill -9``).
:class:`RestartingAsyncVectorEnv` puts a small proxy in front of each worker's pipe; when the pipe
breaks, the worker is started again from the same env factory (so env i again gets seed + i at its
first reset) and the pending command is answered:

* ``reset``: re-sent to the new worker, so the reset (with its seed) is exactly the requested one;
* ``step``: the episode that was running is lost, so the step is reported like a simulator fault
  (:mod:`mmpo.robotics.envs.faults`): reward 0, ``terminated=True``, ``final_info`` with ``fault=True``,
  ``worker_restarted=True``, and the new episode's first observation (SAME_STEP autoreset layout);
* other commands (``get_attr``, ``call``, ...) are re-sent to the new worker.

``worker_restarts`` counts restarts; once it exceeds ``max_restarts`` an :class:`EnvWorkerError`
names the worker, its env and the exit code. Several vector envs can share one limit (a
:class:`RestartBudget` set as their ``restart_budget``: :class:`mmpo.robotics.envs.groups.EnvGroups`). Observations travel through the pipes (no shared
memory), so a new worker needs nothing from the old one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.vector import AsyncVectorEnv, AutoresetMode
from gymnasium.vector.async_vector_env import AsyncState, _async_worker
from gymnasium.vector.utils import CloudpickleWrapper, clear_mpi_env_vars

#: what reading from or writing to a dead worker's pipe raises
_BROKEN_PIPE = (EOFError, OSError)


class EnvWorkerError(RuntimeError):
    """An env worker process died more often than the restart limit allows."""


class RestartBudget:
    """Worker restarts allowed to one or more vector envs together: ``used`` of ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_restarts must be >= 0, got {limit}")
        self.limit, self.used = int(limit), 0


class _WorkerPipe:
    """The parent end of one worker's pipe; a broken pipe becomes a restart of that worker."""

    def __init__(self, owner: RestartingAsyncVectorEnv, index: int, pipe: Any) -> None:
        self.owner, self.index, self.pipe = owner, index, pipe
        self.pending: tuple[str, Any] | None = None
        self.broken = False

    @property
    def closed(self) -> bool:
        return self.pipe.closed

    def close(self) -> None:
        self.pipe.close()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.broken or self.pipe.poll(timeout)

    def send(self, message: tuple[str, Any]) -> None:
        self.pending = message
        try:
            self.pipe.send(message)
        except _BROKEN_PIPE:
            self.broken = True

    def recv(self) -> Any:
        if not self.broken:
            try:
                return self.pipe.recv()
            except _BROKEN_PIPE:
                self.broken = True
        command = self.pending[0] if self.pending is not None else "recv"
        if command == "close":  # nothing to close in a dead worker
            return None, True
        return self.owner._restart_and_answer(self.index, self.pending)


class RestartingAsyncVectorEnv(AsyncVectorEnv):
    """``AsyncVectorEnv`` whose dead workers are restarted (see the module docstring).

    Args:
        env_fns: one env factory per worker (picklable).
        max_restarts: worker restarts allowed over the env's lifetime (all workers together).
        env_names: a description of each env for error messages (e.g. "lift, seed 3").
        **kwargs: passed to ``AsyncVectorEnv`` (``shared_memory`` is always False).
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], *, max_restarts: int = 3,
                 env_names: Sequence[str] | None = None, **kwargs: Any) -> None:
        budget = RestartBudget(max_restarts)
        kwargs["shared_memory"] = False
        super().__init__(env_fns, **kwargs)
        self.restart_budget = budget
        self.worker_restarts = 0  # this env's own restarts (restart_budget.used counts those of all sharing it)
        self.env_names = list(env_names) if env_names is not None else [f"env {i}" for i in range(self.num_envs)]
        self.parent_pipes = [_WorkerPipe(self, index, pipe) for index, pipe in enumerate(self.parent_pipes)]

    @property
    def max_restarts(self) -> int:
        return self.restart_budget.limit

    def _start_worker(self, index: int) -> None:
        """Start worker ``index`` again from its env factory, as ``AsyncVectorEnv.__init__`` does."""
        ctx = multiprocessing.get_context(self.context)
        parent_pipe, child_pipe = ctx.Pipe()
        process = ctx.Process(
            target=self.worker or _async_worker,
            name=f"Worker<{type(self).__name__}>-{index}",
            args=(index, CloudpickleWrapper(self.env_fns[index]), child_pipe, parent_pipe, None, self.error_queue,
                  self.autoreset_mode, None),
        )
        process.daemon = self.daemon
        with clear_mpi_env_vars():
            process.start()
        child_pipe.close()
        proxy = self.parent_pipes[index]
        proxy.pipe.close()
        proxy.pipe, proxy.broken = parent_pipe, False
        self.processes[index] = process

    def _restart_and_answer(self, index: int, pending: tuple[str, Any] | None) -> Any:
        """Restart dead worker ``index`` and return what its pipe would have returned for ``pending``."""
        proxy = self.parent_pipes[index]
        while True:
            old = self.processes[index]
            if old.is_alive():  # its pipe broke but it still runs: it cannot be trusted any more
                old.kill()
            old.join(timeout=5.0)
            budget = self.restart_budget
            if budget.used >= budget.limit:
                self._state = AsyncState.DEFAULT  # nothing is pending any more: close() must not wait
                command = pending[0] if pending is not None else "a command"
                raise EnvWorkerError(
                    f"env worker {index} ({self.env_names[index]}, pid {old.pid}) died (exit code {old.exitcode}) "
                    f"during {command!r}; {budget.used} worker restart(s) already, the limit is "
                    f"max_worker_restarts={budget.limit}"
                )
            budget.used += 1
            self.worker_restarts += 1
            self._start_worker(index)
            command, data = pending if pending is not None else ("reset", {"seed": None, "options": None})
            if command == "step":  # the running episode is gone: end it as a fault, start a new one
                proxy.send(("reset", {"seed": None, "options": None}))
            else:
                proxy.send((command, data))
            if proxy.broken:
                continue
            try:
                result, success = proxy.pipe.recv()
            except _BROKEN_PIPE:
                proxy.broken = True
                continue
            proxy.pending = pending
            if command != "step" or not success:
                return result, success
            return self._lost_episode_step(result), True

    def _lost_episode_step(self, reset_result: tuple[Any, dict[str, Any]]) -> tuple[Any, ...]:
        """A step result that ends the lost episode as a fault and starts the new one (SAME_STEP layout)."""
        obs, reset_info = reset_result
        final_info = {"success": False, "fault": True, "worker_restarted": True}
        if self.autoreset_mode != AutoresetMode.SAME_STEP:
            return obs, 0.0, True, False, {**reset_info, **final_info}
        return obs, 0.0, True, False, {"final_info": final_info, "final_obs": obs, **reset_info}
