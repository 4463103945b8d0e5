"""Backward-compatibility of DPPO: the minibatch loss (per-denoising-step clip schedule, denoising
discount, value loss), ratios and gradients on a fixed tiny batch (float64) against committed values.

Regenerate the artifact with ``python tests/robotics/golden/make_golden.py`` only when a formula is
meant to change.
"""

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


def _load_generator():
    spec = importlib.util.spec_from_file_location("robotics_make_golden", GOLDEN_DIR / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()
GOLDEN = json.loads((GOLDEN_DIR / "dppo_golden.json").read_text())


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return GENERATOR.compute(GENERATOR.build_checkpoint(tmp_path_factory.mktemp("golden_dppo")))


def test_the_golden_batch_exercises_the_clip():
    assert 0 < GOLDEN["metrics"]["policy/clipfrac"] < 1


@pytest.mark.parametrize("key", ["losses/policy", "losses/value", "ratio", "clip_ranges"])
def test_values_match_golden(current, key):
    assert current[key] == pytest.approx(GOLDEN[key], rel=1e-9, abs=1e-12)


def test_metrics_match_golden(current):
    for key, value in GOLDEN["metrics"].items():
        assert current["metrics"][key] == pytest.approx(value, rel=1e-7, abs=1e-10), key


def test_gradients_match_golden(current):
    assert sorted(current["grad"]) == sorted(GOLDEN["grad"])
    for param, fingerprint in GOLDEN["grad"].items():
        assert current["grad"][param] == pytest.approx(fingerprint, rel=1e-8, abs=1e-12), param
