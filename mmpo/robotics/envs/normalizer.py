"""Min-max normalisation of observations and actions to [-1, 1].

DPPO (arXiv 2409.00588; ``script/dataset/process_robomimic_dataset.py``) maps every
obs/action dimension x to ``2 (x - min) / (max - min + 1e-6) - 1`` with per-dimension
min/max over the whole dataset, and the env wrapper maps policy actions back. No
library ships this exact convention (robomimic normalises with mean/std), so it is here.
Stats live in a small JSON file beside the dataset: ``<dataset>.stats.json``; ``mmpo demos``
records the dataset's SHA-256 in it (``data_sha256``) so stats are never used with other data.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from mmpo.files import atomic_write_text, file_sha256

#: DPPO adds this to (max - min) so constant dimensions do not divide by zero.
RANGE_EPSILON = 1e-6
_REQUIRED = ("obs_min", "obs_max", "action_min", "action_max")
#: metadata key holding the SHA-256 of the dataset file the stats were computed from
DATA_HASH_KEY = "data_sha256"


def stats_path_for(dataset_path: str | Path) -> Path:
    """``demos.hdf5`` -> ``demos.hdf5.stats.json`` (the file written beside the dataset)."""
    return Path(f"{dataset_path}.stats.json")


class Normalizer:
    """Per-dimension min-max map to [-1, 1] for observations and actions.

    Args:
        stats: dict with ``obs_min``, ``obs_max`` (obs_dim,), ``action_min``,
            ``action_max`` (action_dim,) as lists/arrays; other keys (e.g. ``obs_keys``,
            ``task``) are kept as metadata and saved back.
    """

    def __init__(self, stats: dict[str, Any]) -> None:
        missing = [key for key in _REQUIRED if key not in stats]
        if missing:
            raise ValueError(f"normaliser stats lack {missing}; got keys {sorted(stats)}")
        self.obs_min = np.asarray(stats["obs_min"], dtype=np.float64)
        self.obs_max = np.asarray(stats["obs_max"], dtype=np.float64)
        self.action_min = np.asarray(stats["action_min"], dtype=np.float64)
        self.action_max = np.asarray(stats["action_max"], dtype=np.float64)
        for low_name, low, high in (("obs", self.obs_min, self.obs_max), ("action", self.action_min, self.action_max)):
            if low.shape != high.shape or low.ndim != 1:
                raise ValueError(f"{low_name}_min {low.shape} and {low_name}_max {high.shape} must be equal 1-D shapes")
            if np.any(high < low):
                bad = np.nonzero(high < low)[0].tolist()
                raise ValueError(f"{low_name}_max < {low_name}_min at dimensions {bad}")
        self.metadata = {key: value for key, value in stats.items() if key not in _REQUIRED}

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_data(cls, obs: np.ndarray, actions: np.ndarray, **metadata: Any) -> "Normalizer":
        """Stats from data: ``obs`` (N, obs_dim), ``actions`` (M, action_dim)."""
        obs = np.asarray(obs, dtype=np.float64).reshape(-1, np.shape(obs)[-1])
        actions = np.asarray(actions, dtype=np.float64).reshape(-1, np.shape(actions)[-1])
        if not (np.isfinite(obs).all() and np.isfinite(actions).all()):
            raise ValueError("cannot compute normaliser stats from non-finite data")
        return cls(
            {
                "obs_min": obs.min(0),
                "obs_max": obs.max(0),
                "action_min": actions.min(0),
                "action_max": actions.max(0),
                **metadata,
            }
        )

    @classmethod
    def load(cls, path: str | Path) -> "Normalizer":
        with open(path) as handle:
            return cls(json.load(handle))

    def save(self, path: str | Path) -> Path:
        """Write the stats JSON atomically (a reader never sees a half-written file)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    def check_belongs_to(self, dataset_path: str | Path, stats_path: str | Path) -> None:
        """Raise if these stats (read from ``stats_path``) were computed from another file than
        ``dataset_path`` (their recorded ``data_sha256`` differs from the file's). Stats without
        a recorded hash (written by hand or by older versions) are accepted with a warning."""
        recorded = self.metadata.get(DATA_HASH_KEY)
        if recorded is None:
            warnings.warn(
                f"normaliser stats {stats_path} record no {DATA_HASH_KEY}; cannot check that they belong to "
                f"{dataset_path} (regenerate with `mmpo demos` to record it)",
                stacklevel=2,
            )
            return
        actual = file_sha256(dataset_path)
        if actual != recorded:
            raise ValueError(
                f"normaliser stats {stats_path} do not belong to the dataset {dataset_path}: the stats were "
                f"computed from a file with sha256 {recorded[:12]}..., the dataset's is {actual[:12]}... "
                "(an interrupted or overwritten `mmpo demos` run, or a dataset edited after its stats were "
                f"written); regenerate both with `mmpo demos ... --out {dataset_path} --overwrite`"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "obs_min": self.obs_min.tolist(),
            "obs_max": self.obs_max.tolist(),
            "action_min": self.action_min.tolist(),
            "action_max": self.action_max.tolist(),
            **self.metadata,
        }

    @property
    def obs_dim(self) -> int:
        return int(self.obs_min.shape[0])

    @property
    def action_dim(self) -> int:
        return int(self.action_min.shape[0])

    # --- maps (last axis = feature dimension; any leading shape) ----------------------
    @staticmethod
    def _to_unit(x, low: np.ndarray, high: np.ndarray):
        return 2.0 * (x - low) / (high - low + RANGE_EPSILON) - 1.0

    @staticmethod
    def _from_unit(y, low: np.ndarray, high: np.ndarray):
        return (y + 1.0) / 2.0 * (high - low + RANGE_EPSILON) + low

    def _check(self, x, dim: int, what: str) -> None:
        if np.shape(x)[-1] != dim:
            raise ValueError(f"{what} has last dimension {np.shape(x)[-1]}, normaliser expects {dim}")

    def normalize_obs(self, obs):
        """(..., obs_dim) -> same shape in [-1, 1] (numpy or torch; dtype preserved)."""
        self._check(obs, self.obs_dim, "observation")
        return self._apply(self._to_unit, obs, self.obs_min, self.obs_max)

    def normalize_action(self, action):
        """(..., action_dim) env action -> [-1, 1]."""
        self._check(action, self.action_dim, "action")
        return self._apply(self._to_unit, action, self.action_min, self.action_max)

    def unnormalize_action(self, action):
        """(..., action_dim) in [-1, 1] -> env action (inverse of :meth:`normalize_action`)."""
        self._check(action, self.action_dim, "action")
        return self._apply(self._from_unit, action, self.action_min, self.action_max)

    @staticmethod
    def _apply(fn, x, low: np.ndarray, high: np.ndarray):
        if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
            array = np.asarray(x)
            dtype = array.dtype if np.issubdtype(array.dtype, np.floating) else np.float64
            return fn(array.astype(np.float64), low, high).astype(dtype)
        import torch  # torch tensors: keep device and dtype

        low_t = torch.as_tensor(low, dtype=x.dtype, device=x.device)
        high_t = torch.as_tensor(high, dtype=x.dtype, device=x.device)
        return fn(x, low_t, high_t)
