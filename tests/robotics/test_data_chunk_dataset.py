"""ChunkDataset on a file laid out exactly like robomimic's released lift/ph/low_dim.hdf5.

The fixture reproduces that file's groups and attributes (robomimic v0.3 / robosuite
v1.4.1 release): data attrs ``total`` and ``env_args`` (the real Lift env_args JSON),
per-demo ``num_samples`` and ``model_file``, obs/next_obs with all eleven low-dim keys,
actions/rewards/dones/states, and the ``mask`` group of filter keys as byte strings.
"""

import json

import h5py
import numpy as np
import pytest
import torch

from mmpo.robotics.data import ChunkDataset, load_demos, read_env_args
from mmpo.robotics.envs import Normalizer

# env_args of robomimic's lift/ph/low_dim_v141.hdf5 (robosuite 1.4.1 OSC_POSE config)
REAL_LIFT_ENV_ARGS = {
    "env_name": "Lift",
    "env_version": "1.4.1",
    "type": 1,
    "env_kwargs": {
        "has_renderer": False,
        "has_offscreen_renderer": False,
        "ignore_done": True,
        "use_object_obs": True,
        "use_camera_obs": False,
        "control_freq": 20,
        "controller_configs": {
            "type": "OSC_POSE",
            "input_max": 1,
            "input_min": -1,
            "output_max": [0.05, 0.05, 0.05, 0.5, 0.5, 0.5],
            "output_min": [-0.05, -0.05, -0.05, -0.5, -0.5, -0.5],
            "kp": 150,
            "damping_ratio": 1,
            "impedance_mode": "fixed",
            "kp_limits": [0, 300],
            "damping_ratio_limits": [0, 10],
            "position_limits": None,
            "orientation_limits": None,
            "uncouple_pos_ori": True,
            "control_delta": True,
            "interpolation": None,
            "ramp_ratio": 0.2,
        },
        "robots": ["Panda"],
        "camera_depths": False,
        "camera_heights": 84,
        "camera_widths": 84,
        "reward_shaping": False,
    },
}
LOW_DIM_KEYS = {
    "object": 10,
    "robot0_eef_pos": 3,
    "robot0_eef_quat": 4,
    "robot0_eef_vel_ang": 3,
    "robot0_eef_vel_lin": 3,
    "robot0_gripper_qpos": 2,
    "robot0_gripper_qvel": 2,
    "robot0_joint_pos": 7,
    "robot0_joint_pos_cos": 7,
    "robot0_joint_pos_sin": 7,
    "robot0_joint_vel": 7,
}
# demo name -> length; names chosen so lexical order (demo_10 < demo_2) differs from index order
DEMO_LENGTHS = {"demo_1": 3, "demo_2": 5, "demo_10": 4}


def _obs_value(demo_index: int, step: int, key_index: int, dim: int) -> np.ndarray:
    # distinct, predictable numbers: 100 * demo + 10 * step + key index (+ 0.01 * dim)
    return 100.0 * demo_index + 10.0 * step + key_index + 0.01 * np.arange(dim)


@pytest.fixture(scope="module")
def robomimic_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("robomimic") / "low_dim.hdf5"
    with h5py.File(path, "w") as handle:
        data = handle.create_group("data")
        data.attrs["env_args"] = json.dumps(REAL_LIFT_ENV_ARGS)
        data.attrs["total"] = sum(DEMO_LENGTHS.values())
        for name, length in DEMO_LENGTHS.items():
            index = int(name.split("_")[1])
            group = data.create_group(name)
            group.attrs["num_samples"] = length
            group.attrs["model_file"] = "<mujoco model='base'></mujoco>"
            # action a_t = (index + t) in every dim, so padding is easy to see
            group.create_dataset("actions", data=np.full((length, 7), 0.0) + (index + np.arange(length))[:, None])
            group.create_dataset("rewards", data=np.r_[np.zeros(length - 1), 1.0])
            group.create_dataset("dones", data=np.r_[np.zeros(length - 1, dtype=np.int64), 1])
            group.create_dataset("states", data=np.zeros((length, 32)))
            for prefix in ("obs", "next_obs"):
                sub = group.create_group(prefix)
                for key_index, (key, dim) in enumerate(LOW_DIM_KEYS.items()):
                    values = np.stack([_obs_value(index, t, key_index, dim) for t in range(length)])
                    sub.create_dataset(key, data=values)
        mask = handle.create_group("mask")
        mask.create_dataset("train", data=np.array([b"demo_1", b"demo_10"]))
        mask.create_dataset("valid", data=np.array([b"demo_2"]))
    return path


def _identity_like_normalizer(obs_dim: int) -> Normalizer:
    # obs range [0, 2000] and action range [0, 20]: values easy to compute by hand
    return Normalizer(
        {"obs_min": [0.0] * obs_dim, "obs_max": [2000.0] * obs_dim, "action_min": [0.0] * 7, "action_max": [20.0] * 7}
    )


def test_loads_real_layout_in_index_order_with_dppo_key_order(robomimic_file):
    demos = load_demos(robomimic_file)
    assert [d.name for d in demos] == ["demo_1", "demo_2", "demo_10"]
    first = demos[0]
    # DPPO order: eef_pos (key 1), eef_quat (key 2), gripper_qpos (key 5), object (key 0)
    expected_step0 = np.concatenate(
        [_obs_value(1, 0, 1, 3), _obs_value(1, 0, 2, 4), _obs_value(1, 0, 5, 2), _obs_value(1, 0, 0, 10)]
    )
    np.testing.assert_allclose(first.obs[0], expected_step0)
    assert first.obs.shape == (3, 19)
    assert read_env_args(robomimic_file)["env_kwargs"]["controller_configs"]["type"] == "OSC_POSE"


def test_chunks_pad_with_last_action_and_normalise(robomimic_file):
    dataset = ChunkDataset(robomimic_file, horizon=4, normalizer=_identity_like_normalizer(19))
    assert len(dataset) == 3 + 5 + 4
    assert (dataset.obs_dim, dataset.action_dim, dataset.num_demos) == (19, 7, 3)
    obs, chunk = dataset[1]  # demo_1, step 1: actions 1+1=2, 3, then padded with 3, 3
    assert obs.shape == (19,) and chunk.shape == (4, 7)
    assert obs.dtype == torch.float32 and chunk.dtype == torch.float32
    scale = 20.0 + 1e-6
    expected_raw = np.array([2.0, 3.0, 3.0, 3.0])
    np.testing.assert_allclose(chunk[:, 0].numpy(), 2.0 * expected_raw / scale - 1.0, atol=1e-6)
    # obs[0] = eef_pos dim 0 of demo_1 step 1 = 100 + 10 + 1 = 111 -> 2 * 111 / 2000.000001 - 1
    np.testing.assert_allclose(obs[0].item(), 2.0 * 111.0 / (2000.0 + 1e-6) - 1.0, atol=1e-6)


def test_obs_history_repeats_first_step(robomimic_file):
    dataset = ChunkDataset(robomimic_file, horizon=2, obs_horizon=3, normalizer=_identity_like_normalizer(19))
    obs, _ = dataset[3 + 1]  # demo_2 (second in index order), step 1
    assert obs.shape == (3, 19)
    raw_first_dim = (obs[:, 0].numpy() + 1.0) / 2.0 * (2000.0 + 1e-6)
    # steps (0, 0, 1) of demo_2: 200 + 10 * t + 1
    np.testing.assert_allclose(raw_first_dim, [201.0, 201.0, 211.0], atol=1e-3)


def test_filter_key_and_stats_from_data(robomimic_file):
    valid = ChunkDataset(robomimic_file, horizon=4, filter_key="valid")
    assert [d.name for d in valid.demos] == ["demo_2"]
    # no stats file beside the data: min/max come from the selected demos, so actions
    # 2..6 map to [-1, ~1]
    np.testing.assert_array_equal(valid.normalizer.action_min, np.full(7, 2.0))
    np.testing.assert_array_equal(valid.normalizer.action_max, np.full(7, 6.0))
    _, chunk = valid[0]
    assert chunk.min().item() == pytest.approx(-1.0)
    with pytest.raises(KeyError, match="filter key 'nope'.*available: \\['train', 'valid'\\]"):
        ChunkDataset(robomimic_file, horizon=4, filter_key="nope")


def test_dimension_mismatch_is_reported(robomimic_file, tmp_path):
    with pytest.raises(ValueError, match="normaliser dims"):
        ChunkDataset(robomimic_file, horizon=4, normalizer=_identity_like_normalizer(23))
    with pytest.raises(KeyError, match="lacks obs keys \\['Can_pos'\\]"):
        load_demos(robomimic_file, ("robot0_eef_pos", "Can_pos"))
    with pytest.raises(FileNotFoundError):
        load_demos(tmp_path / "missing.hdf5")
