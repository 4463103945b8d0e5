"""Intervals for accuracy / success-rate numbers measured over a few seeds and many items (or episodes).

The bench scripts compare policies on the same held-out items (VLM, dLLM) or on the same evaluation
episodes (robotics), over a few training seeds. Their statistics live here.

Data layout of the paired functions: ``per_seed`` is a list (one entry per seed) of dicts
``{name: (n_s,) array of 0/1 (or any per-item value)}`` whose arrays are aligned: position e of every
array is the same item or episode (same env seed and episode number), so policies are compared on the
same inputs. A contrast is a dict of weights over names, e.g. the gain of DPPO over its BC start
``{"dppo/after": 1, "dppo/before": -1}``; its value on one seed is
``sum_name w_name * mean(per_seed[s][name])``, and the reported estimate is the mean of that over seeds
(each seed weighs the same).

Three intervals of a contrast, from the widest view to the narrowest:

- :func:`bootstrap_interval`: hierarchical percentile bootstrap: resample seeds with replacement, then,
  inside each drawn seed, its items with replacement, the same item indices for every name (paired);
- :func:`episode_normal_interval`: normal interval with seeds fixed and items random: per-item contrast
  d_e, standard error sqrt(sum_s var(d)_s / n_s) / S (var with ddof 1);
- :func:`seed_t_interval`: Student-t interval over the S per-seed values (t quantile with S - 1 degrees
  of freedom; undefined, NaN, for one seed).

Besides: :func:`wilson_interval` (a proportion over n items), :func:`mean_std` and
:func:`format_interval` (``n/a`` for an undefined interval).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

Contrast = Mapping[str, float]
"""Weights over names: ``{"a": 1.0, "b": -1.0}`` is a minus b."""

PerSeed = Sequence[Mapping[str, Any]]
"""One dict per seed of aligned 1-D per-item arrays (anything ``np.asarray`` takes)."""

Interval = tuple[float, float]


def normal_quantile(p: float) -> float:
    """The standard normal quantile (``normal_quantile(0.975)`` = 1.959964)."""
    return NormalDist().inv_cdf(p)


def _t_central_probability(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with integer ``df`` (Abramowitz & Stegun 26.7.3-4: a finite series in
    cos(theta), theta = atan(t / sqrt(df)))."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ... up to cos^(df-3)))
        term, series = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            series += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    term, series = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
    for k in range(1, df // 2):
        term *= cos2 * (2 * k - 1) / (2 * k)
        series += term
    return math.sin(theta) * series


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile of probability ``p`` in (0.5, 1) with integer ``df`` >= 1 degrees of freedom
    (``t_quantile(0.975, 1)`` = 12.7062, ``(0.975, 2)`` = 4.3027), by bisection on the exact CDF."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    if not 0.5 < p < 1.0:
        raise ValueError(f"p must lie in (0.5, 1), got {p}")
    central = 2 * p - 1  # P(|T| <= t)
    low, high = 0.0, 1.0
    while _t_central_probability(high, int(df)) < central:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if _t_central_probability(middle, int(df)) < central:
            low = middle
        else:
            high = middle
        if high - low <= 1e-13 * high:
            break
    return (low + high) / 2


def _check(per_seed: PerSeed, contrast: Contrast) -> list[dict[str, np.ndarray]]:
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
    """(n,) the contrast of each paired item / episode: ``sum_name w_name * x_name[e]``."""
    return sum(float(weight) * np.asarray(arrays[name], dtype=float) for name, weight in contrast.items())


def per_seed_values(per_seed: PerSeed, contrast: Contrast) -> np.ndarray:
    """(S,) the contrast of each seed's item means."""
    return np.array([per_episode_contrast(arrays, contrast).mean() for arrays in _check(per_seed, contrast)])


def bootstrap_interval(per_seed: PerSeed, contrast: Contrast, *, level: float = 0.95, n_boot: int = 10_000,
                       seed: int = 0) -> Interval:
    """Hierarchical paired percentile bootstrap (seeds, then items within a seed) of the seed-mean contrast.

    Each replicate draws S seeds with replacement and, for each drawn seed in turn, n_s item indices with
    replacement (one ``numpy.random.default_rng(seed)`` stream, in that order); the replicate is the mean
    over drawn seeds of the mean contrast over drawn items. Returns the ``(1 - level) / 2`` and
    ``(1 + level) / 2`` quantiles (numpy's linear interpolation) of the ``n_boot`` replicates.
    """
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


def episode_normal_interval(per_seed: PerSeed, contrast: Contrast, *, level: float = 0.95) -> Interval:
    """Seeds fixed, items random: mean +- z * sqrt(sum_s var(d_s) / n_s) / S (var ddof 1; 0 for n_s = 1)."""
    differences = [per_episode_contrast(arrays, contrast) for arrays in _check(per_seed, contrast)]
    mean = float(np.mean([d.mean() for d in differences]))
    variance = sum((d.var(ddof=1) if d.size > 1 else 0.0) / d.size for d in differences)
    half = float(normal_quantile(0.5 + level / 2) * np.sqrt(variance) / len(differences))
    return mean - half, mean + half


def seed_t_interval(values: Sequence[float], *, level: float = 0.95) -> Interval:
    """Student-t interval of the mean of per-seed values: mean +- t(S - 1) * sd(ddof 1) / sqrt(S).

    ``(nan, nan)`` for fewer than 2 seeds (no spread to estimate; :func:`format_interval` shows ``n/a``).
    """
    array = np.asarray(values, dtype=float)
    if array.size < 2:
        return float("nan"), float("nan")
    half = float(t_quantile(0.5 + level / 2, array.size - 1) * array.std(ddof=1) / np.sqrt(array.size))
    return float(array.mean() - half), float(array.mean() + half)


def summarize_contrast(per_seed: PerSeed, contrast: Contrast, *, level: float = 0.95, n_boot: int = 10_000,
                       seed: int = 0) -> dict[str, Any]:
    """Estimate, per-seed values and the three intervals of one contrast.

    Returns ``{"estimate", "per_seed", "bootstrap", "episode_normal", "seed_t", "level"}``.
    """
    values = per_seed_values(per_seed, contrast)
    return {
        "estimate": float(values.mean()),
        "per_seed": [float(v) for v in values],
        "bootstrap": bootstrap_interval(per_seed, contrast, level=level, n_boot=n_boot, seed=seed),
        "episode_normal": episode_normal_interval(per_seed, contrast, level=level),
        "seed_t": seed_t_interval(values, level=level),
        "level": level,
    }


def paired_difference(per_seed_a: Sequence[Sequence[float]], per_seed_b: Sequence[Sequence[float]], *,
                      level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> dict[str, Any]:
    """a - b per seed, paired by item (``per_seed_a[s][i]`` and ``per_seed_b[s][i]`` score the same item):
    :func:`summarize_contrast` of ``{"a": 1, "b": -1}``."""
    if len(per_seed_a) != len(per_seed_b):
        raise ValueError(f"{len(per_seed_a)} seeds of a against {len(per_seed_b)} of b")
    per_seed = [{"a": np.asarray(a, dtype=float), "b": np.asarray(b, dtype=float)}
                for a, b in zip(per_seed_a, per_seed_b)]
    return summarize_contrast(per_seed, {"a": 1.0, "b": -1.0}, level=level, n_boot=n_boot, seed=seed)


def wilson_interval(p: float, n: int, z: float = 1.96) -> Interval:
    """Wilson score interval of a proportion ``p`` observed on ``n`` items (z = 1.96: 95%)."""
    if n < 1:
        raise ValueError(f"a proportion needs n >= 1 items, got {n}")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def mean_std(values: Sequence[float]) -> str:
    """``"mean ± sd"`` (sd with ddof 1; 0 for one value), three decimals."""
    array = np.asarray(values, dtype=float)
    return f"{array.mean():.3f} ± {array.std(ddof=1) if len(array) > 1 else 0.0:.3f}"


def format_interval(pair: Sequence[float], *, undefined: str = "n/a") -> str:
    """``[+lo, +hi]`` with signs and three decimals; ``undefined`` when either end is NaN (one seed)."""
    if any(value != value for value in pair):
        return undefined
    return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"
