"""Scripted Can expert: one clean episode reaches the bin; demo layout for Can."""

import h5py
import numpy as np

from mmpo.robotics.data import ChunkDataset
from mmpo.robotics.demos import generate_demos


def test_can_expert_places_can_in_bin(tmp_path):
    out = tmp_path / "can.hdf5"
    stats = generate_demos("can", 1, out, noise=0.0, seed=0, store_model_file=False, progress=False)
    assert stats["success_rate"] == 1.0 and stats["num_demos"] == 1
    # grasp, lift, carry, lower, release, retreat: ~170 steps of the 300-step limit
    assert 60 < stats["mean_length"] < 300
    with h5py.File(out, "r") as handle:
        demo = handle["data"]["demo_0"]
        assert demo["obs"]["object"].shape[1] == 14
        assert demo["rewards"][-1] == 1.0 and demo["dones"][-1] == 1
        assert "model_file" not in demo.attrs
        gripper = demo["actions"][:, 6]
        # the gripper closes (grasp) and later opens again (release)
        closed = np.nonzero(gripper > 0)[0]
        assert closed.size and np.any(gripper[closed[-1] + 1 :] < 0)
    dataset = ChunkDataset(out, horizon=4)
    assert dataset.obs_dim == 23 and len(dataset) == stats["total_samples"]
