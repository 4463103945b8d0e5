"""Write demonstrations in robomimic's HDF5 layout.

Layout (robomimic docs, "Dataset Structure"; checked against robomimic's SequenceDataset):

    data/                       attrs: total (int), env_args (JSON string)
      demo_0/                   attrs: num_samples (int), model_file (MJCF XML string)
        obs/<key>               (T, d) float64, one dataset per low-dim key
        next_obs/<key>          (T, d)
        actions                 (T, 7) float64
        rewards                 (T,)   float64
        dones                   (T,)   int64 (1 at the last step)
        states                  (T, state_dim) float64 flattened MuJoCo state
    mask/train, mask/valid      demo names as bytes (robomimic filter keys)

Each demo is flushed as soon as it is written, so a crash loses at most the current one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np


class RobomimicHDF5Writer:
    """Append demos one at a time; ``close()`` (or the context manager) writes the masks."""

    def __init__(self, path: str | Path, env_args: dict[str, Any], *, valid_fraction: float = 0.1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.valid_fraction = float(valid_fraction)
        self.file = h5py.File(self.path, "w")
        self.data = self.file.create_group("data")
        self.data.attrs["env_args"] = json.dumps(env_args)
        self.data.attrs["total"] = 0
        self.demo_names: list[str] = []

    def add_demo(
        self,
        obs: dict[str, np.ndarray],
        next_obs: dict[str, np.ndarray],
        actions: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
        states: np.ndarray,
        model_file: str | None = None,
    ) -> str:
        """Write one demo; every array has the same first dimension T. Returns its name."""
        length = int(np.shape(actions)[0])
        arrays = {"actions": actions, "rewards": rewards, "dones": dones, "states": states}
        arrays.update({f"obs/{k}": v for k, v in obs.items()})
        arrays.update({f"next_obs/{k}": v for k, v in next_obs.items()})
        for name, value in arrays.items():
            if np.shape(value)[0] != length:
                raise ValueError(f"demo array {name!r} has {np.shape(value)[0]} steps, actions have {length}")
        if length == 0:
            raise ValueError("cannot write an empty demo")
        name = f"demo_{len(self.demo_names)}"
        group = self.data.create_group(name)
        group.attrs["num_samples"] = length
        if model_file is not None:
            group.attrs["model_file"] = model_file
        group.create_dataset("actions", data=np.asarray(actions, dtype=np.float64))
        group.create_dataset("rewards", data=np.asarray(rewards, dtype=np.float64))
        group.create_dataset("dones", data=np.asarray(dones, dtype=np.int64))
        group.create_dataset("states", data=np.asarray(states, dtype=np.float64))
        for prefix, source in (("obs", obs), ("next_obs", next_obs)):
            sub = group.create_group(prefix)
            for key, value in source.items():
                sub.create_dataset(key, data=np.asarray(value))
        self.demo_names.append(name)
        self.data.attrs["total"] = int(self.data.attrs["total"]) + length
        self.file.flush()
        return name

    def close(self) -> None:
        if not self.file.id.valid:
            return
        count = len(self.demo_names)
        num_valid = int(round(self.valid_fraction * count)) if count > 1 else 0
        # robomimic's split_train_val_from_hdf5 uses a random split; a fixed tail split keeps
        # the file a pure function of the seed and the demo order.
        splits = {"train": self.demo_names[: count - num_valid], "valid": self.demo_names[count - num_valid :]}
        mask = self.file.create_group("mask")
        for key, names in splits.items():
            mask.create_dataset(key, data=np.array([n.encode("utf-8") for n in names], dtype="S"))
        self.file.close()

    def __enter__(self) -> "RobomimicHDF5Writer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
