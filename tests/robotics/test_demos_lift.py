"""Scripted Lift demos: robomimic HDF5 layout, read back by robomimic itself."""

import json

import h5py
import numpy as np
import pytest

from mmpo.robotics.data import ChunkDataset, load_demos
from mmpo.robotics.demos import generate_demos
from mmpo.robotics.envs import OBS_KEYS, Normalizer

NUM_DEMOS = 2


@pytest.fixture(scope="module")
def lift_demos(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    stats = generate_demos("lift", NUM_DEMOS, out, noise=0.0, seed=0, progress=False)
    return out, stats


def test_expert_succeeds_and_reports(lift_demos):
    path, stats = lift_demos
    assert stats["num_demos"] == NUM_DEMOS
    assert stats["success_rate"] == 1.0 and stats["attempts"] == NUM_DEMOS
    assert stats["stats_path"] == f"{path}.stats.json"
    # the scripted lift takes ~35 steps; robomimic's human PH demos ~50
    assert 15 < stats["mean_length"] < 120


def test_robomimic_layout(lift_demos):
    path, stats = lift_demos
    with h5py.File(path, "r") as handle:
        data = handle["data"]
        env_args = json.loads(data.attrs["env_args"])
        assert env_args["env_name"] == "Lift" and env_args["type"] == 1
        kwargs = env_args["env_kwargs"]
        assert kwargs["control_freq"] == 20 and kwargs["reward_shaping"] is False and kwargs["ignore_done"] is True
        assert kwargs["robots"] == ["Panda"]
        assert kwargs["controller_configs"]["body_parts"]["right"]["type"] == "OSC_POSE"
        names = sorted(data.keys())
        assert names == [f"demo_{i}" for i in range(NUM_DEMOS)]
        total = 0
        for name in names:
            demo = data[name]
            length = int(demo.attrs["num_samples"])
            total += length
            assert demo["actions"].shape == (length, 7)
            assert demo["rewards"].shape == (length,) and demo["dones"].shape == (length,)
            assert demo["dones"][-1] == 1 and demo["dones"][:-1].sum() == 0
            assert demo["rewards"][-1] == 1.0  # sparse reward: the demo ends holding the cube up
            assert demo["states"].shape[0] == length and "model_file" in demo.attrs
            for key, dim in (("robot0_eef_pos", 3), ("robot0_eef_quat", 4), ("robot0_gripper_qpos", 2), ("object", 10)):
                assert demo["obs"][key].shape == (length, dim)
                assert demo["next_obs"][key].shape == (length, dim)
            # next_obs[t] is obs[t + 1]
            np.testing.assert_allclose(demo["next_obs"]["object"][:-1], demo["obs"]["object"][1:])
            assert np.all(np.abs(demo["actions"][:]) <= 1.0)
        assert int(data.attrs["total"]) == total == stats["total_samples"]
        assert [n.decode() for n in handle["mask"]["train"][:]] + [
            n.decode() for n in handle["mask"]["valid"][:]
        ] == names


def test_robomimic_sequence_dataset_reads_file(lift_demos):
    import robomimic.utils.obs_utils as ObsUtils
    from robomimic.utils.dataset import SequenceDataset

    path, stats = lift_demos
    keys = list(OBS_KEYS["lift"])
    ObsUtils.initialize_obs_utils_with_obs_specs({"obs": {"low_dim": keys, "rgb": []}})
    dataset = SequenceDataset(
        hdf5_path=str(path),
        obs_keys=keys,
        dataset_keys=("actions", "rewards", "dones"),
        seq_length=4,
        hdf5_cache_mode="all",
        filter_by_attribute="train",
    )
    assert len(dataset) == stats["total_samples"]
    item = dataset[0]
    assert item["actions"].shape == (4, 7)
    assert item["obs"]["object"].shape == (4, 10)
    ours = load_demos(path)[0]
    np.testing.assert_allclose(item["actions"], ours.actions[:4])
    np.testing.assert_allclose(item["obs"]["robot0_eef_pos"][0], ours.obs[0, :3])


def test_states_and_env_args_recreate_the_scene(lift_demos):
    import robosuite

    from mmpo.robotics.envs.robosuite_compat import apply_robosuite_compat

    path, _ = lift_demos
    apply_robosuite_compat()
    with h5py.File(path, "r") as handle:
        env_args = json.loads(handle["data"].attrs["env_args"])
        demo = handle["data"]["demo_0"]
        states = demo["states"][:]
        eef = demo["obs"]["robot0_eef_pos"][:]
        cube = demo["obs"]["object"][:, :3]
    # what robomimic's EnvUtils.create_env_from_metadata does with the metadata
    env = robosuite.make(env_args["env_name"], **env_args["env_kwargs"])
    try:
        env.reset()
        step = len(states) // 2
        env.sim.set_state_from_flattened(states[step])
        env.sim.forward()
        np.testing.assert_allclose(env.sim.get_state().flatten(), states[step])
        obs = env._get_observations(force_update=True)
        # robosuite reads observables after the last physics substep without a forward
        # pass, so recorded site positions lag the state by one 2 ms substep (< 1 mm).
        np.testing.assert_allclose(obs["robot0_eef_pos"], eef[step], atol=1e-3)
        np.testing.assert_allclose(obs["cube_pos"], cube[step], atol=1e-3)
        assert np.linalg.norm(obs["robot0_eef_pos"] - eef[len(states) // 4]) > 5e-3  # other steps differ
    finally:
        env.close()


def test_chunk_dataset_uses_saved_stats(lift_demos):
    path, stats = lift_demos
    dataset = ChunkDataset(path, horizon=4)
    saved = Normalizer.load(stats["stats_path"])
    np.testing.assert_array_equal(dataset.normalizer.obs_min, saved.obs_min)
    assert saved.metadata["obs_keys"] == list(OBS_KEYS["lift"])
    assert len(dataset) == stats["total_samples"]
    obs = np.stack([dataset[i][0].numpy() for i in range(len(dataset))])
    assert obs.min() >= -1.0 - 1e-6 and obs.max() <= 1.0 + 1e-6


def test_failures_kept_or_reported(tmp_path):
    # 5 steps are too few to lift the cube: every attempt fails
    stats = generate_demos("lift", 1, tmp_path / "fail.hdf5", max_steps=5, keep_failures=True, progress=False)
    assert stats["success_rate"] == 0.0 and stats["num_demos"] == 1 and stats["total_samples"] == 5
    with pytest.raises(RuntimeError, match="no demo written for 'lift' after 2 attempts"):
        generate_demos("lift", 1, tmp_path / "none.hdf5", max_steps=5, max_attempts=2, progress=False)
    with pytest.raises(ValueError, match="robosuite tasks only"):
        generate_demos("hopper", 1, tmp_path / "h.hdf5")
    with pytest.raises(ValueError, match="unknown task 'stack'"):
        generate_demos("stack", 1, tmp_path / "s.hdf5")
