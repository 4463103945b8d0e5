"""make_env: robomimic-style robosuite tasks and gymnasium Hopper."""

import numpy as np
import pytest

from mmpo.robotics.envs import OBS_KEYS, get_task, make_env


@pytest.fixture(scope="module")
def lift_env():
    env = make_env("lift", seed=7, max_episode_steps=6)
    yield env
    env.close()


def test_lift_spaces_keys_and_controller(lift_env):
    assert OBS_KEYS["lift"] == ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object")
    assert lift_env.observation_space.shape == (19,)
    assert lift_env.action_space.shape == (7,)
    np.testing.assert_array_equal(lift_env.action_space.low, -np.ones(7))
    sim_env = lift_env.unwrapped.sim_env
    assert sim_env.control_freq == 20 and sim_env.reward_shaping is False
    assert sim_env.robots[0].part_controllers["right"].name == "OSC_POSE"
    obs, info = lift_env.reset(seed=7)
    assert obs.dtype == np.float32 and obs.shape == (19,)
    raw = lift_env.unwrapped.last_raw_obs
    # flattened in the documented key order: eef_pos, eef_quat, gripper_qpos, object-state
    np.testing.assert_allclose(obs[:3], raw["robot0_eef_pos"], rtol=1e-6)
    np.testing.assert_allclose(obs[7:9], raw["robot0_gripper_qpos"], rtol=1e-6)
    np.testing.assert_allclose(obs[9:], raw["object-state"], rtol=1e-6)
    assert info == {"success": False, "fault": False}


def test_lift_seeding_time_limit_and_success_flag(lift_env):
    first, _ = lift_env.reset(seed=3)
    again, _ = lift_env.reset(seed=3)
    other, _ = lift_env.reset(seed=4)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first[9:12], other[9:12])  # cube placement depends on the seed
    lift_env.reset(seed=3)
    for step in range(6):
        obs, reward, terminated, truncated, info = lift_env.step(np.zeros(7))
        assert info["success"] is False and info["fault"] is False and reward == 0.0
        assert not terminated
        assert truncated == (step == 5)


def test_can_observation_is_23_dim():
    spec = get_task("can")
    assert (spec.sim_name, spec.obs_dim, spec.max_episode_steps) == ("PickPlaceCan", 23, 300)
    env = make_env("can", seed=0, max_episode_steps=2)
    try:
        obs, info = env.reset()
        assert obs.shape == (23,) and info["success"] is False
        obs, _, _, _, info = env.step(np.zeros(7))
        assert "success" in info and np.isfinite(obs).all()
    finally:
        env.close()


def test_hopper_family():
    env = make_env("hopper", seed=0, max_episode_steps=3)
    try:
        obs, _ = env.reset()
        assert obs.shape == (11,) and env.action_space.shape == (3,)
        truncated = False
        for _ in range(3):
            obs, reward, terminated, truncated, info = env.step(np.zeros(3))
            assert info["fault"] is False
        assert truncated or terminated
    finally:
        env.close()


def test_render_and_camera_observation(monkeypatch):
    from mmpo.robotics.envs import ActionChunkWrapper, Normalizer

    normalizer = Normalizer(
        {"obs_min": [-2.0] * 19, "obs_max": [2.0] * 19, "action_min": [-1.0] * 7, "action_max": [1.0] * 7}
    )
    env = make_env("lift", seed=0, render=True, camera="agentview", image_size=64, max_episode_steps=4)
    env = ActionChunkWrapper(env, act_steps=2, normalizer=normalizer)
    try:
        obs, _ = env.reset()
        assert set(obs) == {"state", "image"}
        assert obs["state"].shape == (19,) and np.abs(obs["state"]).max() <= 1.0
        assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
        # upright image: the bright table fills the bottom rows, the darker background the top
        assert obs["image"][-8:].mean() > obs["image"][:8].mean()
        frame = env.render()
        assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8 and frame.std() > 5
        obs, _, _, _, _ = env.step(np.zeros((2, 7)))
        assert obs["image"].shape == (64, 64, 3)

        def no_gl(**kwargs):
            raise OSError("EGL: no display (injected)")

        monkeypatch.setattr(env.unwrapped.sim_env.sim, "render", no_gl)
        with pytest.raises(RuntimeError, match="offscreen rendering failed for Lift .*MUJOCO_GL='egl'.*no display"):
            env.render()
    finally:
        env.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown task 'stack'; valid tasks: \\['can', 'hopper', 'lift', 'lift_img', 'square', 'stl_pointmass2'"):
        make_env("stack")
    with pytest.raises(ValueError, match="only supported for robosuite tasks"):
        make_env("hopper", camera="agentview")
    with pytest.raises(ValueError, match="max_episode_steps must be >= 1"):
        make_env("lift", max_episode_steps=-1)
