"""Subprocess vector envs: per-env seeds, chunk steps, SAME_STEP autoreset, fault counters."""

import numpy as np
import pytest

from mmpo.robotics.envs import Normalizer, make_vector_env, measure_steps_per_s, merged_info


def test_async_lift_two_envs(tmp_path):
    stats = tmp_path / "lift.hdf5.stats.json"
    Normalizer(
        {"obs_min": [-2.0] * 19, "obs_max": [2.0] * 19, "action_min": [-1.0] * 7, "action_max": [1.0] * 7}
    ).save(stats)
    # 3 chunk steps of 4 fill the 12-step limit: the third step ends both episodes
    env = make_vector_env("lift", 2, seed=5, act_steps=4, normalizer_path=stats, max_episode_steps=12)
    try:
        assert env.num_envs == 2 and env.single_action_space.shape == (4, 7)
        assert env.metadata["autoreset_mode"].name == "SAME_STEP"
        obs, info = env.reset(seed=5)
        assert obs.shape == (2, 19) and obs.dtype == np.float32
        assert not np.allclose(obs[0, 9:12], obs[1, 9:12])  # seeds 5 and 6: different cube placements
        assert np.abs(obs).max() <= 1.0
        for step in range(3):
            obs, reward, terminated, truncated, info = env.step(np.zeros((2, 4, 7), dtype=np.float32))
            np.testing.assert_array_equal(reward, [0.0, 0.0])
            assert not terminated.any()
            assert truncated.all() == (step == 2)
        # SAME_STEP: the returned obs is already the next episode's first; the final one is kept
        assert info["_final_info"].all() and info["final_obs"][0].shape == (19,)
        np.testing.assert_array_equal(merged_info(info, "executed_steps", 0), [4, 4])
        np.testing.assert_array_equal(merged_info(info, "success"), [False, False])
        assert env.get_attr("fault_count") == (0, 0)
    finally:
        env.close()


def test_merged_info_prefers_final_info():
    infos = {
        "success": np.array([False, False, True]),
        "_final_info": np.array([True, False, False]),
        "final_info": {"success": np.array([True, False, False])},
    }
    np.testing.assert_array_equal(merged_info(infos, "success"), [True, False, True])


def test_measure_steps_per_s_reports_both_rates(monkeypatch):
    import types

    import mmpo.robotics.envs.vector as vector

    # a scripted clock: the raw loop takes 2 s (1 s of CPU), the vector loop 4 s
    wall, cpu = iter([100.0, 102.0, 200.0, 204.0]), iter([10.0, 11.0])
    monkeypatch.setattr(vector, "time", types.SimpleNamespace(perf_counter=lambda: next(wall),
                                                              process_time=lambda: next(cpu)))
    result = measure_steps_per_s("hopper", num_envs=1, steps=6, act_steps=4)
    # raw: 6 steps / 2 s; vector: 6 steps rounded up to 2 chunks of 4 = 8 steps / 4 s
    assert result["raw_steps_per_s"] == 3.0 and result["vector_steps_per_s"] == 2.0
    assert result["speedup"] == pytest.approx(2.0 / 3.0)
    assert result["raw_cpu_s_per_step"] == pytest.approx(1.0 / 6.0)
    assert (result["num_envs"], result["act_steps"], result["steps"]) == (1.0, 4.0, 6.0)


def test_fault_in_one_env_is_counted_and_the_run_goes_on():
    # in-process vector env so the fault can be injected into env 0's simulator
    env = make_vector_env("lift", 2, seed=0, act_steps=2, max_episode_steps=50, asynchronous=False)
    try:
        env.reset(seed=0)
        env.envs[0].unwrapped.sim_env.sim.data._data.qvel[:] = 1e12  # MuJoCo instability
        obs, reward, terminated, truncated, info = env.step(np.zeros((2, 2, 7)))
        np.testing.assert_array_equal(terminated, [True, False])
        np.testing.assert_array_equal(merged_info(info, "fault"), [True, False])
        np.testing.assert_array_equal(merged_info(info, "success"), [False, False])
        assert np.isfinite(obs).all() and reward[0] == 0.0
        assert env.get_attr("fault_count") == (1, 0)
        # env 0 was reset within the step (SAME_STEP); both keep running
        obs, reward, terminated, truncated, info = env.step(np.zeros((2, 2, 7)))
        assert not terminated.any() and not info["fault"].any()
        assert env.get_attr("fault_count") == (1, 0)
    finally:
        env.close()
