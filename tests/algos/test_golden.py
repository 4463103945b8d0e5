"""Backward-compatibility of the VLM algorithms: one training step of PAPO-G, PAPO-D, MAPO, StepGRPO,
GCPO and AHPO on a fixed tiny batch (float64) against committed metrics and gradient fingerprints.

Regenerate the artifact with ``python tests/algos/golden/make_golden.py`` only when a formula is
meant to change.
"""

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


def _load_generator():
    spec = importlib.util.spec_from_file_location("algos_make_golden", GOLDEN_DIR / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()
GOLDEN = json.loads((GOLDEN_DIR / "algos_golden.json").read_text())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return GENERATOR.build_model(tmp_path_factory.mktemp("golden_vlm"))


def test_every_algorithm_has_a_golden_entry():
    assert sorted(GOLDEN) == sorted(GENERATOR.ALGORITHMS)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_step_matches_golden(name, model_path):
    golden, current = GOLDEN[name], GENERATOR.run(name, model_path)
    # every stored metric is still logged with the same value (new metrics may be added)
    for key, value in golden["metrics"].items():
        assert key in current["metrics"], key
        assert current["metrics"][key] == pytest.approx(value, rel=1e-7, abs=1e-10), key
    assert sorted(current["grad"]) == sorted(golden["grad"])
    for param, fingerprint in golden["grad"].items():
        assert current["grad"][param] == pytest.approx(fingerprint, rel=1e-6, abs=1e-12), param
