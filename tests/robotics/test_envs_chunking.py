"""ActionChunkWrapper on a hand-made env (exact numbers) and on robosuite Lift."""

import gymnasium as gym
import numpy as np
import pytest

from mmpo.robotics.envs import ActionChunkWrapper, Normalizer, SimulatorFaultWrapper, make_env


class CountingEnv(gym.Env):
    """obs = [steps taken, last action[0]]; reward = action[0]; terminates after ``length`` steps."""

    def __init__(self, length: int = 5):
        self.length = length
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)
        self.action_space = gym.spaces.Box(-10.0, 10.0, shape=(2,), dtype=np.float64)
        self.received: list[np.ndarray] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.array([0.0, 0.0]), {"success": False}

    def step(self, action):
        self.received.append(np.array(action))
        self.steps += 1
        obs = np.array([float(self.steps), float(action[0])])
        return obs, float(action[0]), self.steps >= self.length, False, {"success": self.steps == 2}


def _normalizer():
    # obs: [0, 4] and [0, 2]; actions: [0, 2] in both dims
    return Normalizer({"obs_min": [0.0, 0.0], "obs_max": [4.0, 2.0], "action_min": [0.0, 0.0], "action_max": [2.0, 2.0]})


def test_chunk_sums_rewards_and_unnormalises_actions():
    base = CountingEnv(length=10)
    env = ActionChunkWrapper(SimulatorFaultWrapper(base), act_steps=3, normalizer=_normalizer())
    assert env.action_space.shape == (3, 2)
    env.reset()
    chunk = np.array([[-1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    obs, reward, terminated, truncated, info = env.step(chunk)
    # unnormalise: (a + 1) / 2 * (2 + 1e-6) + 0 -> 0, 1.0000005, 2.000001
    received = np.array(base.received)
    np.testing.assert_allclose(received[:, 0], [0.0, 1.0000005, 2.000001], atol=1e-12)
    # reward = sum of action[0] = 0 + 1.0000005 + 2.000001 = 3.0000015
    assert reward == pytest.approx(3.0000015, abs=1e-9)
    assert (terminated, truncated) == (False, False)
    # obs after 3 steps = [3, 2.000001] -> 2 * 3 / 4.000001 - 1 = 0.4999996..., 2 * 2.000001 / 2.000001 - 1 = 1
    np.testing.assert_allclose(obs, [2.0 * 3.0 / 4.000001 - 1.0, 1.0], atol=1e-6)
    assert obs.dtype == np.float32
    assert info["executed_steps"] == 3 and info["success_any"] is True and info["success"] is False


def test_chunk_stops_at_episode_end_and_accepts_longer_chunks():
    base = CountingEnv(length=5)
    env = ActionChunkWrapper(SimulatorFaultWrapper(base), act_steps=4, normalizer=None)
    env.reset()
    env.step(np.ones((4, 2)))
    # Ta = 6 > act_steps: only the first 4 rows may run, and the episode ends after 1
    obs, reward, terminated, truncated, info = env.step(np.full((6, 2), 2.0))
    assert terminated and info["executed_steps"] == 1 and reward == 2.0
    assert len(base.received) == 5
    with pytest.raises(ValueError, match="shape \\(>= 4, 2\\), got \\(3, 2\\)"):
        env.step(np.zeros((3, 2)))


def test_time_limit_truncates_inside_a_chunk():
    env = ActionChunkWrapper(gym.wrappers.TimeLimit(CountingEnv(length=100), max_episode_steps=6), act_steps=4)
    env.reset()
    _, _, _, truncated, info = env.step(np.zeros((4, 2)))
    assert not truncated and info["executed_steps"] == 4
    _, _, _, truncated, info = env.step(np.zeros((4, 2)))
    assert truncated and info["executed_steps"] == 2


def test_lift_chunks_in_normalised_space(tmp_path):
    normalizer = Normalizer(
        {"obs_min": [-2.0] * 19, "obs_max": [2.0] * 19, "action_min": [-1.0] * 7, "action_max": [1.0] * 7}
    )
    env = ActionChunkWrapper(make_env("lift", seed=0, max_episode_steps=8), act_steps=4, normalizer=normalizer)
    try:
        obs, info = env.reset()
        raw = env.unwrapped.last_raw_obs["robot0_eef_pos"]
        np.testing.assert_allclose(obs[:3], 2.0 * (raw + 2.0) / (4.0 + 1e-6) - 1.0, atol=1e-6)
        up = np.zeros((4, 7))
        up[:, 2] = 1.0  # +z at full speed for 4 steps
        obs, reward, terminated, truncated, info = env.step(up)
        raw_after = env.unwrapped.last_raw_obs["robot0_eef_pos"]
        assert raw_after[2] > raw[2] + 0.02
        assert reward == 0.0 and info["executed_steps"] == 4 and info["fault_count"] == 0
        _, _, _, truncated, info = env.step(up)
        assert truncated and info["executed_steps"] == 4
    finally:
        env.close()


class ResetCountingEnv(CountingEnv):
    """CountingEnv that counts its resets (what a skipped autoreset saves)."""

    resets = 0

    def reset(self, *, seed=None, options=None):
        self.resets += 1
        self.options_seen = options
        return super().reset(seed=seed, options=options)


def _counting_vector_env(length: int, act_steps: int):
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    return SyncVectorEnv([lambda: ActionChunkWrapper(ResetCountingEnv(length), act_steps=act_steps)],
                         autoreset_mode=AutoresetMode.SAME_STEP)


def test_autoreset_after_the_armed_chunk_step_is_skipped_and_the_env_refuses_to_step():
    from mmpo.robotics.envs.chunking import SKIP_AUTORESET_AFTER

    # episodes of 4 steps = 2 chunks of 2; armed for 4 chunk steps: the end at chunk 2 resets, the end at 4 does not
    vec = _counting_vector_env(length=4, act_steps=2)
    wrapper, base = vec.envs[0], vec.envs[0].env
    vec.reset(seed=0, options={SKIP_AUTORESET_AFTER: 4})
    assert base.resets == 1 and base.options_seen is None  # the option is the wrapper's own, not passed on
    chunk = np.ones((1, 2, 2))
    vec.step(chunk)
    obs, _, terminated, _, info = vec.step(chunk)  # chunk 2: the episode ends and SAME_STEP resets it
    assert terminated[0] and base.resets == 2
    np.testing.assert_array_equal(obs[0], [0.0, 0.0])  # the new episode's first obs
    np.testing.assert_array_equal(info["final_obs"][0], [4.0, 1.0])
    vec.step(chunk)
    obs, _, terminated, _, info = vec.step(chunk)  # chunk 4: the episode ends, its reset is skipped
    assert terminated[0] and base.resets == 2 and wrapper.skipped_resets == 1
    np.testing.assert_array_equal(obs[0], [4.0, 1.0])  # the finished episode's last obs, not a reset obs
    np.testing.assert_array_equal(info["final_obs"][0], [4.0, 1.0])
    assert info["reset_skipped"][0]
    with pytest.raises(RuntimeError, match="autoreset was skipped"):
        vec.step(chunk)
    obs, _ = vec.reset(seed=1)  # an explicit reset without the option: a real reset, disarmed
    assert base.resets == 3
    np.testing.assert_array_equal(obs[0], [0.0, 0.0])
    for _ in range(4):
        obs, _, terminated, _, _ = vec.step(chunk)
    assert terminated[0] and base.resets == 5 and wrapper.skipped_resets == 1
    np.testing.assert_array_equal(obs[0], [0.0, 0.0])


def test_skip_option_only_skips_an_end_on_that_exact_chunk_step():
    from mmpo.robotics.envs.chunking import SKIP_AUTORESET_AFTER

    vec = _counting_vector_env(length=4, act_steps=2)
    vec.reset(seed=0, options={SKIP_AUTORESET_AFTER: 3})  # the episode ends on chunk 2 and 4, never on 3
    for _ in range(4):
        obs, _, terminated, _, _ = vec.step(np.ones((1, 2, 2)))
    assert terminated[0] and vec.envs[0].env.resets == 3 and vec.envs[0].skipped_resets == 0
    np.testing.assert_array_equal(obs[0], [0.0, 0.0])
    with pytest.raises(ValueError, match="must be >= 1"):
        vec.reset(seed=0, options={SKIP_AUTORESET_AFTER: 0})
