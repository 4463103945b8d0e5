"""mmpo.eval.stats (the bench scripts' intervals) on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mmpo.eval import stats
from mmpo.eval.stats import (
    bootstrap_interval,
    episode_normal_interval,
    format_interval,
    mean_std,
    paired_difference,
    per_seed_values,
    seed_t_interval,
    summarize_contrast,
    t_quantile,
    wilson_interval,
)

GAIN = {"after": 1.0, "before": -1.0}
# seed 0: 2/4 -> 4/4 (gain 0.5); seed 1: 3/4 -> 4/4 (gain 0.25)
TWO_SEEDS = [{"before": np.array([0, 0, 1, 1]), "after": np.array([1, 1, 1, 1])},
             {"before": np.array([0, 1, 1, 1]), "after": np.array([1, 1, 1, 1])}]


def test_t_quantile_by_hand():
    # df 1 (Cauchy): tan(pi (p - 1/2)); df 2: q = (2p - 1) sqrt(2 / (1 - (2p - 1)^2))
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)
    assert t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95 ** 2)), rel=1e-10)
    assert t_quantile(0.9, 2) == pytest.approx(0.8 * math.sqrt(2 / (1 - 0.8 ** 2)), rel=1e-10)
    # tables: t(0.975, 3) = 3.182446, (0.975, 4) = 2.776445, (0.975, 10) = 2.228139; large df -> normal 1.959964
    assert t_quantile(0.975, 3) == pytest.approx(3.182446305, rel=1e-8)
    assert t_quantile(0.975, 4) == pytest.approx(2.776445105, rel=1e-8)
    assert t_quantile(0.975, 10) == pytest.approx(2.228138852, rel=1e-8)
    assert t_quantile(0.975, 10_000) == pytest.approx(1.959963985, rel=1e-3)
    assert stats.normal_quantile(0.975) == pytest.approx(1.959963984540054)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


def test_seed_t_interval_on_three_numbers_by_hand():
    # 1, 2, 3: mean 2, sd 1, standard error 1 / sqrt(3); t(0.975, 2) = 0.95 sqrt(2 / 0.0975) = 4.3026527
    half = 0.95 * math.sqrt(2 / 0.0975) / math.sqrt(3)
    assert half == pytest.approx(2.4841377, abs=1e-6)
    assert seed_t_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - half, 2 + half))
    # two seeds: 0.5, 0.25: mean 0.375, sd 0.1767767, / sqrt(2) = 0.125, t(0.975, df 1) = 12.7062047
    low, high = seed_t_interval([0.5, 0.25])
    assert (low, high) == pytest.approx((0.375 - 12.706204736 * 0.125, 0.375 + 12.706204736 * 0.125))


def test_one_seed_has_no_t_interval_and_prints_n_a():
    interval = seed_t_interval([0.5])
    assert all(math.isnan(v) for v in interval)
    assert format_interval(interval) == "n/a"
    assert format_interval(interval, undefined="n/a (1 seed)") == "n/a (1 seed)"
    assert format_interval((-0.0125, 0.5)) == "[-0.013, +0.500]"
    one = summarize_contrast(TWO_SEEDS[:1], GAIN, n_boot=20)
    assert one["estimate"] == 0.5 and all(math.isnan(v) for v in one["seed_t"])


def test_per_seed_values_and_estimate_by_hand():
    assert per_seed_values(TWO_SEEDS, GAIN).tolist() == [0.5, 0.25]
    assert summarize_contrast(TWO_SEEDS, GAIN, n_boot=10)["estimate"] == pytest.approx(0.375)


def test_episode_normal_interval_by_hand():
    # d = [1, 1, 0, 0]: var (ddof 1) 1/3, / 4 = 1/12; d = [1, 0, 0, 0]: var 1/4, / 4 = 1/16; SE = sqrt(7/48) / 2
    half = 1.959963984540054 * math.sqrt(7 / 48) / 2
    low, high = episode_normal_interval(TWO_SEEDS, GAIN)
    assert (low, high) == pytest.approx((0.375 - half, 0.375 + half))


def test_bootstrap_with_a_fixed_seed_by_hand():
    # x (seed 0) = [1, 0, 1], x (seed 1) = [0, 0, 1]. default_rng(7) draws, per replicate, the seeds then each
    # drawn seed's items:
    #   seeds [1, 1], items [2, 2, 1] -> 1, 1, 0 and [2, 2, 0] -> 1, 1, 0: (2/3 + 2/3) / 2 = 2/3
    #   seeds [0, 0], items [0, 2, 2] -> 1, 1, 1 and [0, 1, 2] -> 1, 0, 1: (1 + 2/3) / 2 = 5/6
    #   seeds [0, 1], items [0, 1, 2] -> 1, 0, 1 and [0, 1, 0] -> 0, 0, 0: (2/3 + 0) / 2 = 1/3
    rng = np.random.default_rng(7)
    draws = []
    for _ in range(3):
        seeds = rng.integers(0, 2, size=2).tolist()
        draws.append([seeds, *[rng.integers(0, 3, size=3).tolist() for _ in seeds]])
    assert draws == [[[1, 1], [2, 2, 1], [2, 2, 0]], [[0, 0], [0, 2, 2], [0, 1, 2]], [[0, 1], [0, 1, 2], [0, 1, 0]]]
    per_seed = [{"x": [1, 0, 1]}, {"x": [0, 0, 1]}]
    # replicates sorted 1/3, 2/3, 5/6; linear quantiles at positions 0.05 and 1.95 (q x (3 - 1)):
    # 1/3 + 0.05 / 3 = 0.35 and 2/3 + 0.95 / 6 = 0.825; level 0.5: positions 0.5 and 1.5 -> 0.5 and 0.75
    assert bootstrap_interval(per_seed, {"x": 1.0}, n_boot=3, seed=7) == pytest.approx((0.35, 0.825))
    assert bootstrap_interval(per_seed, {"x": 1.0}, n_boot=3, seed=7, level=0.5) == pytest.approx((0.5, 0.75))


def test_bootstrap_degenerate_cases_are_exact():
    # every episode of every seed gains exactly 1: every resample gives 1
    certain = [{"before": np.zeros(5), "after": np.ones(5)} for _ in range(3)]
    assert bootstrap_interval(certain, GAIN, n_boot=200) == (1.0, 1.0)
    # pairing: before == after episode by episode (but varying over episodes), so every paired resample
    # gives exactly 0; an unpaired resampling would spread around 0
    same = [{"before": np.array([0, 1, 1, 0, 1]), "after": np.array([0, 1, 1, 0, 1])} for _ in range(3)]
    assert bootstrap_interval(same, GAIN, n_boot=200) == (0.0, 0.0)
    # a four-way contrast that cancels episode by episode (both methods gain alike) is exactly 0 too
    both = [{"a/before": np.array([0, 1, 0]), "a/after": np.array([1, 1, 0]),
             "b/before": np.array([1, 0, 0]), "b/after": np.array([1, 1, 0])}]  # d_a = [1, 0, 0], d_b = [0, 1, 0]
    difference = {"a/after": 1, "a/before": -1, "b/after": -1, "b/before": 1}
    assert per_seed_values(both, difference).tolist() == [0.0]
    low, high = bootstrap_interval(both, difference, n_boot=500)
    assert -1.0 <= low < 0.0 < high <= 1.0  # per-episode differences +1, -1, 0: not degenerate


def test_bootstrap_is_seeded_and_brackets_the_estimate():
    first = bootstrap_interval(TWO_SEEDS, GAIN, n_boot=2000, seed=3)
    assert first == bootstrap_interval(TWO_SEEDS, GAIN, n_boot=2000, seed=3)
    assert 0.0 <= first[0] < 0.375 < first[1] <= 1.0


def test_arrays_must_align():
    with pytest.raises(ValueError, match="one length"):
        per_seed_values([{"before": np.zeros(3), "after": np.zeros(4)}], GAIN)
    with pytest.raises(ValueError, match="at least one seed"):
        per_seed_values([], GAIN)


def test_paired_difference_is_a_minus_b():
    summary = paired_difference([[1, 1, 1, 1], [1, 1, 1, 1]], [[0, 0, 1, 1], [0, 1, 1, 1]], n_boot=50)
    assert summary["per_seed"] == pytest.approx([0.5, 0.25])
    assert summary["seed_t"] == pytest.approx((0.375 - 12.706204736 * 0.125, 0.375 + 12.706204736 * 0.125))
    with pytest.raises(ValueError, match="seeds"):
        paired_difference([[1]], [[0], [1]])


def test_wilson_interval_by_hand():
    # p 0.5, n 4, z 2: centre (0.5 + 4/8) / (1 + 4/4) = 0.5; half 2 sqrt(0.25/4 + 4/64) / 2 = sqrt(0.125)
    low, high = wilson_interval(0.5, 4, z=2.0)
    assert (low, high) == pytest.approx((0.5 - math.sqrt(0.125), 0.5 + math.sqrt(0.125)))
    # p 0: the lower end is exactly 0 (centre = half = (z^2 / 2n) / (1 + z^2 / n))
    low, high = wilson_interval(0.0, 10)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(2 * (1.96 ** 2 / 20) / (1 + 1.96 ** 2 / 10))
    with pytest.raises(ValueError):
        wilson_interval(0.5, 0)


def test_mean_std_text():
    assert mean_std([1.0, 2.0, 3.0]) == "2.000 ± 1.000"
    assert mean_std([0.25]) == "0.250 ± 0.000"
