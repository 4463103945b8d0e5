"""Min-max normaliser: hand-computed values, inverse, persistence, bad input."""

import json

import numpy as np
import pytest
import torch

from mmpo.robotics.envs import Normalizer, stats_path_for
from mmpo.robotics.envs.normalizer import RANGE_EPSILON


def _normalizer():
    return Normalizer(
        {"obs_min": [0.0, -2.0], "obs_max": [4.0, 2.0], "action_min": [-1.0], "action_max": [3.0], "task": "toy"}
    )


def test_normalize_obs_hand_computed():
    norm = _normalizer()
    # dim 0: 2 * (1 - 0) / (4 - 0 + 1e-6) - 1 = 2 / 4.000001 - 1 = 0.499999875 - 1 = -0.500000125
    # dim 1: 2 * (2 - -2) / (2 - -2 + 1e-6) - 1 = 8 / 4.000001 - 1 = 1.9999995 - 1 = 0.9999995
    out = norm.normalize_obs(np.array([1.0, 2.0]))
    expected = np.array([2.0 / (4.0 + RANGE_EPSILON) - 1.0, 8.0 / (4.0 + RANGE_EPSILON) - 1.0])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out, [-0.500000125, 0.9999995], atol=1e-9)


def test_action_round_trip_and_endpoints():
    norm = _normalizer()
    # min -> -1; max -> 2 * 4 / 4.000001 - 1 = 0.9999995
    np.testing.assert_allclose(norm.normalize_action(np.array([[-1.0], [3.0]])), [[-1.0], [0.9999995]], atol=1e-9)
    # unnormalise(0) = (0 + 1) / 2 * 4.000001 + (-1) = 1.0000005
    np.testing.assert_allclose(norm.unnormalize_action(np.array([0.0])), [1.0000005], atol=1e-12)
    actions = np.random.default_rng(0).uniform(-1, 3, size=(5, 3, 1))
    np.testing.assert_allclose(norm.unnormalize_action(norm.normalize_action(actions)), actions, atol=1e-12)


def test_torch_tensors_keep_dtype():
    norm = _normalizer()
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    out = norm.normalize_obs(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), norm.normalize_obs(x.numpy().astype(np.float64)), atol=1e-6)


def test_from_data_save_load(tmp_path):
    obs = np.array([[0.0, 5.0], [2.0, 1.0], [1.0, 3.0]])
    actions = np.array([[1.0], [-1.0]])
    norm = Normalizer.from_data(obs, actions, obs_keys=["a", "b"])
    np.testing.assert_array_equal(norm.obs_min, [0.0, 1.0])
    np.testing.assert_array_equal(norm.obs_max, [2.0, 5.0])
    path = norm.save(stats_path_for(tmp_path / "demo.hdf5"))
    assert path.name == "demo.hdf5.stats.json"
    loaded = Normalizer.load(path)
    assert json.loads(path.read_text())["obs_keys"] == ["a", "b"]
    np.testing.assert_array_equal(loaded.action_max, [1.0])
    np.testing.assert_allclose(loaded.normalize_obs(obs), norm.normalize_obs(obs))


def test_bad_input_named():
    with pytest.raises(ValueError, match="action_max"):
        Normalizer({"obs_min": [0.0], "obs_max": [1.0], "action_min": [0.0]})
    with pytest.raises(ValueError, match="obs_max < obs_min at dimensions \\[1\\]"):
        Normalizer({"obs_min": [0.0, 2.0], "obs_max": [1.0, 1.0], "action_min": [0.0], "action_max": [1.0]})
    with pytest.raises(ValueError, match="last dimension 3"):
        _normalizer().normalize_obs(np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        Normalizer.from_data(np.array([[np.nan]]), np.array([[0.0]]))
