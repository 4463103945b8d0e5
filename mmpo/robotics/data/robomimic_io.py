"""Read robomimic-layout HDF5 files (ours and robomimic's released low_dim.hdf5 alike).

robomimic's ``SequenceDataset`` would do this too, but it needs its global ObsUtils
registry initialised and returns per-key dicts; the policy side wants one flat state
vector per step in DPPO's key order, so this small reader sits beside it (a test checks
that robomimic's own SequenceDataset reads our files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mmpo.robotics.envs.tasks import ROBOMIMIC_LOW_DIM_KEYS


@dataclass
class Demo:
    """One trajectory: obs (T, obs_dim), actions (T, action_dim), rewards (T,), dones (T,)."""

    name: str
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray


def demo_names(handle: h5py.File, filter_key: str | None = None) -> list[str]:
    """Demo group names, sorted by index as robomimic does (demo_2 before demo_10)."""
    if "data" not in handle:
        raise KeyError(f"{handle.filename}: no 'data' group; not a robomimic-layout HDF5 file")
    if filter_key is None:
        names = [name for name in handle["data"].keys() if name.startswith("demo_")]
    else:
        if "mask" not in handle or filter_key not in handle["mask"]:
            available = sorted(handle["mask"].keys()) if "mask" in handle else []
            raise KeyError(f"{handle.filename}: filter key {filter_key!r} not in mask/ (available: {available})")
        names = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in handle["mask"][filter_key][:]]
    return sorted(names, key=lambda name: int(name.split("_")[-1]))


def read_env_args(path: str | Path) -> dict[str, Any]:
    """``data.attrs["env_args"]`` parsed from JSON."""
    with h5py.File(path, "r") as handle:
        return json.loads(handle["data"].attrs["env_args"])


def load_demos(
    path: str | Path,
    obs_keys: tuple[str, ...] | list[str] = ROBOMIMIC_LOW_DIM_KEYS,
    *,
    filter_key: str | None = None,
) -> list[Demo]:
    """Load every demo with its low-dim obs keys concatenated in ``obs_keys`` order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"demo file not found: {path}")
    demos = []
    with h5py.File(path, "r") as handle:
        for name in demo_names(handle, filter_key):
            group = handle["data"][name]
            missing = [key for key in obs_keys if key not in group["obs"]]
            if missing:
                raise KeyError(f"{path}:{name} lacks obs keys {missing}; has {sorted(group['obs'].keys())}")
            parts = [np.asarray(group["obs"][key], dtype=np.float64) for key in obs_keys]
            parts = [part.reshape(part.shape[0], -1) for part in parts]
            actions = np.asarray(group["actions"], dtype=np.float64)
            length = actions.shape[0]
            rewards = np.asarray(group["rewards"], dtype=np.float64) if "rewards" in group else np.zeros(length)
            dones = np.asarray(group["dones"], dtype=np.int64) if "dones" in group else np.zeros(length, np.int64)
            demos.append(Demo(name, np.concatenate(parts, axis=1), actions, rewards, dones))
    if not demos:
        raise ValueError(f"{path} holds no demos (filter_key={filter_key!r})")
    return demos
