"""Backward-compatibility of DPPO: the minibatch loss (per-denoising-step clip schedule, denoising
discount, value loss), ratios and gradients on a fixed tiny batch (float64) against committed values.
Regenerate: ``python tests/robotics/golden/make_golden.py`` (only for an intended formula change).
"""

from pathlib import Path

import pytest
from golden_support import assert_step_matches, load_golden

GENERATOR, GOLDEN = load_golden(Path(__file__).parent / "golden", "dppo_golden.json")


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return GENERATOR.compute(GENERATOR.build_checkpoint(tmp_path_factory.mktemp("golden_dppo")))


def test_the_golden_batch_exercises_the_clip():
    assert 0 < GOLDEN["metrics"]["policy/clipfrac"] < 1


@pytest.mark.parametrize("key", ["losses/policy", "losses/value", "ratio", "clip_ranges"])
def test_values_match_golden(current, key):
    assert current[key] == pytest.approx(GOLDEN[key], rel=1e-9, abs=1e-12)


def test_metrics_and_gradients_match_golden(current):
    assert_step_matches(current, GOLDEN, metric_rel=1e-7, grad_rel=1e-8)
