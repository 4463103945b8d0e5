"""Injected simulator faults end the episode as a failure; reset recovers; faults are counted."""

import mujoco
import numpy as np
import pytest

from mmpo.robotics.envs import ActionChunkWrapper, SimulatorFaultError, fault_count, make_env


@pytest.fixture(scope="module")
def lift_chunk_env():
    env = ActionChunkWrapper(make_env("lift", seed=0, max_episode_steps=40), act_steps=2)
    yield env
    env.close()


def _inject(monkeypatch, env, behaviour):
    sim_env = env.unwrapped.sim_env
    real_step = sim_env.step
    calls = {"n": 0}

    def faulty_step(action):
        calls["n"] += 1
        if calls["n"] == 2:  # the second simulator step of the chunk breaks
            return behaviour(real_step, action)
        return real_step(action)

    monkeypatch.setattr(sim_env, "step", faulty_step)
    return calls


def _raise_fatal(real_step, action):
    raise mujoco.FatalError("mj_stackAlloc: insufficient memory (injected)")


def _nan_obs(real_step, action):
    obs, reward, done, info = real_step(action)
    obs = dict(obs)
    obs["object-state"] = np.full_like(obs["object-state"], np.nan)
    return obs, reward, done, info


@pytest.mark.parametrize(
    "behaviour, reason", [(_raise_fatal, "FatalError: mj_stackAlloc"), (_nan_obs, "non-finite observation")]
)
def test_fault_ends_episode_and_reset_recovers(monkeypatch, lift_chunk_env, behaviour, reason):
    env = lift_chunk_env
    before = env.fault_count
    env.reset(seed=1)
    calls = _inject(monkeypatch, env, behaviour)
    obs, reward, terminated, truncated, info = env.step(np.zeros((2, 7)))
    assert calls["n"] == 2
    assert terminated and not truncated and reward == 0.0
    assert info["fault"] is True and info["success"] is False and reason in info["fault_reason"]
    assert np.isfinite(obs).all()  # the last good observation, never NaN
    assert env.fault_count == before + 1 == info["fault_count"] == fault_count(env)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(np.zeros((2, 7)))
    monkeypatch.undo()
    obs, info = env.reset()
    assert np.isfinite(obs).all() and info["fault"] is False
    obs, reward, terminated, truncated, info = env.step(np.zeros((2, 7)))
    assert not terminated and info["fault"] is False and env.fault_count == before + 1


def test_real_mujoco_instability_is_detected(lift_chunk_env):
    env = lift_chunk_env
    before = env.fault_count
    env.reset(seed=2)
    # absurd joint velocities make MuJoCo flag bad qvel/qacc and silently reset its state
    env.unwrapped.sim_env.sim.data._data.qvel[:] = 1e12
    _, reward, terminated, _, info = env.step(np.zeros((2, 7)))
    assert terminated and reward == 0.0 and info["fault"] is True
    assert "instability" in info["fault_reason"] and env.fault_count == before + 1
    env.reset()
    _, _, terminated, _, info = env.step(np.zeros((2, 7)))
    assert not terminated and info["fault"] is False


def test_reset_that_keeps_failing_raises(monkeypatch, lift_chunk_env):
    sim_env = lift_chunk_env.unwrapped.sim_env

    def broken_reset():
        raise mujoco.FatalError("injected reset failure")

    monkeypatch.setattr(sim_env, "reset", broken_reset)
    with pytest.raises(SimulatorFaultError, match="reset failed 3 times; last error: FatalError"):
        lift_chunk_env.reset()
