"""Intervals for success-rate contrasts from paired evaluation episodes over a few seeds (issue 19).

Data layout: ``per_seed`` is a list (one entry per seed) of dicts ``{name: (n_s,) array of 0/1 (or any
per-episode value)}`` whose arrays are aligned: position e of every array is the same evaluation episode
(same env seed and episode number), so policies are compared on the same initial states. A contrast is a
dict of weights over names, e.g. the gain of DPPO over its BC start ``{"dppo/after": 1, "dppo/before": -1}``;
its value on one seed is ``sum_name w_name * mean(per_seed[s][name])``, and the reported estimate is the
mean of that over seeds (each seed weighs the same).

Three intervals, from the widest view to the narrowest:

- ``bootstrap``: hierarchical percentile bootstrap: resample seeds with replacement, then, inside each
  drawn seed, its episodes with replacement, the same episode indices for every name (paired);
- ``episode_normal``: normal interval with seeds fixed and episodes random: per-episode contrast d_e, standard
  error sqrt(sum_s var(d)_s / n_s) / S (var with ddof 1);
- ``seed_t``: Student-t interval over the S per-seed values (t quantile with S - 1 degrees of freedom).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy import stats

Contrast = Mapping[str, float]


def _check(per_seed: Sequence[Mapping[str, np.ndarray]], contrast: Contrast) -> list[dict[str, np.ndarray]]:
    if not per_seed:
        raise ValueError("need at least one seed")
    checked = []
    for index, seed in enumerate(per_seed):
        arrays = {name: np.asarray(seed[name], dtype=float) for name in contrast}
        sizes = {array.shape for array in arrays.values()}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1 or next(iter(sizes))[0] < 1:
            raise ValueError(f"seed {index}: the contrast's arrays must be 1-D, non-empty and of one length, got "
                             f"{ {name: array.shape for name, array in arrays.items()} }")
        checked.append(arrays)
    return checked


def per_episode_contrast(arrays: Mapping[str, np.ndarray], contrast: Contrast) -> np.ndarray:
    """(n,) the contrast of each paired episode: sum_name w_name * x_name[e]."""
    return sum(float(weight) * arrays[name] for name, weight in contrast.items())


def per_seed_values(per_seed: Sequence[Mapping[str, np.ndarray]], contrast: Contrast) -> np.ndarray:
    """(S,) the contrast of each seed's episode means."""
    return np.array([per_episode_contrast(arrays, contrast).mean() for arrays in _check(per_seed, contrast)])


def bootstrap_interval(per_seed: Sequence[Mapping[str, np.ndarray]], contrast: Contrast, *, level: float = 0.95,
                       n_boot: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Hierarchical paired percentile bootstrap (seeds, then episodes within a seed) of the seed-mean contrast."""
    differences = [per_episode_contrast(arrays, contrast) for arrays in _check(per_seed, contrast)]
    rng = np.random.default_rng(seed)
    count = len(differences)
    values = np.empty(n_boot)
    for replicate in range(n_boot):
        drawn = rng.integers(0, count, size=count)
        values[replicate] = np.mean([differences[s][rng.integers(0, differences[s].size, size=differences[s].size)].mean()
                                     for s in drawn])
    alpha = (1.0 - level) / 2
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return float(low), float(high)


def episode_normal_interval(per_seed: Sequence[Mapping[str, np.ndarray]], contrast: Contrast, *,
                            level: float = 0.95) -> tuple[float, float]:
    """Seeds fixed, episodes random: mean +- z * sqrt(sum_s var(d_s) / n_s) / S (var ddof 1; 0 for n_s = 1)."""
    differences = [per_episode_contrast(arrays, contrast) for arrays in _check(per_seed, contrast)]
    mean = float(np.mean([d.mean() for d in differences]))
    variance = sum((d.var(ddof=1) if d.size > 1 else 0.0) / d.size for d in differences)
    half = float(stats.norm.ppf(0.5 + level / 2) * np.sqrt(variance) / len(differences))
    return mean - half, mean + half


def seed_t_interval(values: Sequence[float], *, level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean of per-seed values (NaN for fewer than 2 seeds)."""
    values = np.asarray(values, dtype=float)
    if values.size < 2:
        return float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / np.sqrt(values.size))
    return float(values.mean() - half), float(values.mean() + half)


def summarize_contrast(per_seed: Sequence[Mapping[str, np.ndarray]], contrast: Contrast, *, level: float = 0.95,
                       n_boot: int = 10_000, seed: int = 0) -> dict[str, object]:
    """Estimate, per-seed values and the three intervals of one contrast."""
    values = per_seed_values(per_seed, contrast)
    return {
        "estimate": float(values.mean()),
        "per_seed": [float(v) for v in values],
        "bootstrap": bootstrap_interval(per_seed, contrast, level=level, n_boot=n_boot, seed=seed),
        "episode_normal": episode_normal_interval(per_seed, contrast, level=level),
        "seed_t": seed_t_interval(values, level=level),
        "level": level,
    }
