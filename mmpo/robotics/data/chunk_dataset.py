"""(observation, action chunk) pairs for diffusion-policy behaviour cloning.

Follows DPPO's ``StitchedSequenceDataset`` (arXiv 2409.00588, ``agent/dataset/sequence.py``)
and Diffusion Policy: one sample per demo step t, observation history of ``obs_horizon``
steps ending at t (the first step repeated at the demo start), actions t..t+Ta-1 with the
last action repeated past the demo end. Everything in the normaliser's [-1, 1] space.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from mmpo.robotics.data.finite import drop_nonfinite_demos
from mmpo.robotics.data.robomimic_io import Demo, load_demos
from mmpo.robotics.envs.normalizer import Normalizer, stats_path_for
from mmpo.robotics.envs.tasks import ROBOMIMIC_LOW_DIM_KEYS


class ChunkDataset(Dataset):
    """Torch dataset of ``(obs, action_chunk)`` float32 tensors.

    Args:
        hdf5_path: robomimic-layout file (ours or robomimic's low_dim.hdf5).
        horizon: Ta, the action-chunk length.
        obs_horizon: observation history length (1 in all DPPO experiments).
        normalizer: a :class:`Normalizer`, a path to a stats JSON, or ``None`` = use
            ``<hdf5_path>.stats.json`` if it exists, else compute min/max from this data.
        obs_keys: low-dim keys concatenated into the state (default robomimic's
            robot0_eef_pos, robot0_eef_quat, robot0_gripper_qpos, object).
        filter_key: robomimic mask name (e.g. "train", "valid") to select demos.
        on_nonfinite: a demo with a NaN/inf observation or action is an error naming it ("error")
            or is dropped and counted in ``skipped_demos`` ("skip").

    Shapes: ``obs`` (obs_dim,) when obs_horizon == 1, else (obs_horizon, obs_dim);
    ``action_chunk`` (horizon, action_dim).
    """

    def __init__(
        self,
        hdf5_path: str | Path,
        *,
        horizon: int,
        obs_horizon: int = 1,
        normalizer: Normalizer | str | Path | None = None,
        obs_keys: tuple[str, ...] | list[str] = ROBOMIMIC_LOW_DIM_KEYS,
        filter_key: str | None = None,
        on_nonfinite: str = "error",
    ) -> None:
        if horizon < 1 or obs_horizon < 1:
            raise ValueError(f"horizon and obs_horizon must be >= 1, got {horizon}, {obs_horizon}")
        self.hdf5_path = Path(hdf5_path)
        self.horizon = int(horizon)
        self.obs_horizon = int(obs_horizon)
        self.obs_keys = tuple(obs_keys)
        self.demos: list[Demo] = load_demos(self.hdf5_path, self.obs_keys, filter_key=filter_key)
        self.demos, self.skipped_demos = drop_nonfinite_demos(self.demos, self.hdf5_path, on_nonfinite)
        self.normalizer = self._resolve_normalizer(normalizer)
        self._obs = [self.normalizer.normalize_obs(d.obs).astype(np.float32) for d in self.demos]
        self._actions = [self.normalizer.normalize_action(d.actions).astype(np.float32) for d in self.demos]
        # flat index -> (demo index, step)
        self._index = np.array(
            [(i, t) for i, demo in enumerate(self.demos) for t in range(len(demo.actions))], dtype=np.int64
        )

    def _resolve_normalizer(self, normalizer: Normalizer | str | Path | None) -> Normalizer:
        if isinstance(normalizer, Normalizer):
            result = normalizer
        elif normalizer is not None:
            result = Normalizer.load(normalizer)
        elif stats_path_for(self.hdf5_path).exists():
            result = Normalizer.load(stats_path_for(self.hdf5_path))
            result.check_belongs_to(self.hdf5_path, stats_path_for(self.hdf5_path))
        else:
            result = Normalizer.from_data(
                np.concatenate([d.obs for d in self.demos]),
                np.concatenate([d.actions for d in self.demos]),
                obs_keys=list(self.obs_keys),
            )
        stats = (result.obs_min, result.obs_max, result.action_min, result.action_max)
        if not all(np.isfinite(values).all() for values in stats):
            raise ValueError(f"normaliser stats for {self.hdf5_path} hold non-finite values (NaN/inf); recompute them")
        if result.obs_dim != self.obs_dim or result.action_dim != self.action_dim:
            raise ValueError(
                f"normaliser dims (obs {result.obs_dim}, action {result.action_dim}) do not match "
                f"{self.hdf5_path} (obs {self.obs_dim}, action {self.action_dim})"
            )
        return result

    @property
    def obs_dim(self) -> int:
        return int(self.demos[0].obs.shape[1])

    @property
    def action_dim(self) -> int:
        return int(self.demos[0].actions.shape[1])

    @property
    def num_demos(self) -> int:
        return len(self.demos)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        demo_index, step = (int(v) for v in self._index[index])
        obs, actions = self._obs[demo_index], self._actions[demo_index]
        last = len(actions) - 1
        action_steps = np.minimum(np.arange(step, step + self.horizon), last)
        chunk = actions[action_steps]
        if self.obs_horizon == 1:
            obs_out = obs[step]
        else:
            obs_out = obs[np.maximum(np.arange(step - self.obs_horizon + 1, step + 1), 0)]
        return torch.from_numpy(np.ascontiguousarray(obs_out)), torch.from_numpy(np.ascontiguousarray(chunk))
