"""Backward-compatibility of IGPO (dllm.rl.DiffuGRPO): one training step with scripted rollouts on a
seeded tiny mask predictor (float64) against committed metrics and gradient fingerprints.

Regenerate the artifact with ``python tests/dllm/golden/make_golden.py`` only when a formula is
meant to change.
"""

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


def _load_generator():
    spec = importlib.util.spec_from_file_location("dllm_make_golden", GOLDEN_DIR / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()
GOLDEN = json.loads((GOLDEN_DIR / "dllm_golden.json").read_text())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return GENERATOR.build_model(tmp_path_factory.mktemp("golden_dllm") / "start")


def test_every_configuration_has_a_golden_entry():
    assert sorted(GOLDEN) == sorted(GENERATOR.CONFIGS)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_step_matches_golden(name, model_path, tmp_path):
    golden, current = GOLDEN[name], GENERATOR.run(name, model_path, tmp_path)
    # every stored metric is still logged with the same value (Lightning logs float32; new metrics may be added)
    for key, value in golden["metrics"].items():
        assert key in current["metrics"], key
        assert current["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert sorted(current["grad"]) == sorted(golden["grad"])
    for param, fingerprint in golden["grad"].items():
        assert current["grad"][param] == pytest.approx(fingerprint, rel=1e-6, abs=1e-12), param
