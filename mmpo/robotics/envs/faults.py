"""Simulator-fault guard: a crashed or diverged step ends the episode as a failure.

Long RL runs on MuJoCo occasionally hit a physics blow-up (non-finite state, MuJoCo's
own "bad qacc" reset, an exception from the bindings). Instead of killing a run with
many parallel envs, the faulty step is reported as ``terminated=True``, reward 0,
``info["fault"]=True``, ``info["success"]=False``; the next ``reset()`` rebuilds the
scene (robosuite hard reset / gymnasium reset) and the fault is counted.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import mujoco
import numpy as np

_INSTABILITY_WARNINGS = (
    int(mujoco.mjtWarning.mjWARN_BADQPOS),
    int(mujoco.mjtWarning.mjWARN_BADQVEL),
    int(mujoco.mjtWarning.mjWARN_BADQACC),
)
#: how often reset() is retried after a fault before giving up
MAX_RESET_ATTEMPTS = 3


def simulator_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the simulator broke", not "the caller has a bug"."""
    errors: list[type[BaseException]] = [
        mujoco.FatalError,
        mujoco.UnexpectedError,
        FloatingPointError,
        np.linalg.LinAlgError,
    ]
    try:
        from robosuite.utils.errors import SimulationError

        errors.append(SimulationError)
    except ImportError:  # robosuite is optional for the gymnasium tasks
        pass
    return tuple(errors)


class SimulatorFaultError(RuntimeError):
    """The environment could not be recovered by resetting it."""


def _raw_mujoco_data(env: gym.Env) -> Any | None:
    """The ``mujoco.MjData`` behind a robosuite adapter or a gymnasium MuJoCo env."""
    base = env.unwrapped
    sim_env = getattr(base, "sim_env", None)
    if sim_env is not None and getattr(sim_env, "sim", None) is not None:
        return sim_env.sim.data._data
    data = getattr(base, "data", None)
    return data if isinstance(data, mujoco.MjData) else None


def _all_finite(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    array = np.asarray(value)
    return not np.issubdtype(array.dtype, np.floating) or bool(np.isfinite(array).all())


class SimulatorFaultWrapper(gym.Wrapper):
    """Turns simulator faults into failed episode ends and counts them.

    Attributes:
        fault_count: faults seen since construction.
        last_fault_reason: text of the latest fault ("" if none).
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.fault_count = 0
        self.last_fault_reason = ""
        self._needs_reset = True
        self._last_obs: Any = None
        self._errors = simulator_error_types()

    def _instability_count(self) -> int:
        data = _raw_mujoco_data(self.env)
        if data is None:
            return 0
        return int(sum(data.warning[index].number for index in _INSTABILITY_WARNINGS))

    def _fault(self, reason: str):
        self.fault_count += 1
        self.last_fault_reason = reason
        self._needs_reset = True
        info = {"success": False, "fault": True, "fault_reason": reason}
        return self._last_obs, 0.0, True, False, info

    def step(self, action):
        if self._needs_reset:
            raise RuntimeError("step() called before reset() (or after a fault/episode end without reset())")
        warnings_before = self._instability_count()
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except self._errors as error:
            return self._fault(f"{type(error).__name__}: {error}")
        if not _all_finite(obs) or not np.isfinite(reward):
            return self._fault("non-finite observation or reward")
        if self._instability_count() > warnings_before:
            return self._fault("MuJoCo instability warning (bad qpos/qvel/qacc; MuJoCo reset the state)")
        info = dict(info)
        info["fault"] = False
        self._last_obs = obs
        if terminated or truncated:
            self._needs_reset = True
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        last_error = "unknown"
        for attempt in range(MAX_RESET_ATTEMPTS):
            try:
                obs, info = self.env.reset(seed=seed if attempt == 0 else None, options=options)
            except self._errors as error:
                last_error = f"{type(error).__name__}: {error}"
                continue
            if _all_finite(obs):
                self._needs_reset = False
                self._last_obs = obs
                info = dict(info)
                info["fault"] = False
                return obs, info
            last_error = "non-finite observation after reset"
        raise SimulatorFaultError(f"reset failed {MAX_RESET_ATTEMPTS} times; last error: {last_error}")


def find_fault_wrapper(env: gym.Env) -> SimulatorFaultWrapper | None:
    """The :class:`SimulatorFaultWrapper` inside a wrapper stack (None if there is none)."""
    current = env
    while isinstance(current, gym.Wrapper):
        if isinstance(current, SimulatorFaultWrapper):
            return current
        current = current.env
    return None


def fault_count(env: gym.Env) -> int:
    """Simulator faults counted so far by the env's fault guard (0 without one)."""
    guard = find_fault_wrapper(env)
    return 0 if guard is None else guard.fault_count
