"""Backward-compatibility of IGPO (mmpo.dllm.rl.DiffuGRPO): one training step with scripted rollouts on a
seeded tiny mask predictor (float64) against committed metrics and gradient fingerprints.
Regenerate: ``python tests/dllm/golden/make_golden.py`` (only for an intended formula change).
"""

from pathlib import Path

import pytest
from golden_support import assert_step_matches, load_golden

GENERATOR, GOLDEN = load_golden(Path(__file__).parent / "golden", "dllm_golden.json")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return GENERATOR.build_model(tmp_path_factory.mktemp("golden_dllm") / "start")


def test_every_configuration_has_a_golden_entry():
    assert sorted(GOLDEN) == sorted(GENERATOR.CONFIGS)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_step_matches_golden(name, model_path, tmp_path):
    # Lightning logs metrics as float32, hence their looser tolerance (another processor type moved them by
    # <= 8.9e-7 relative, 2026-12-01)
    assert_step_matches(GENERATOR.run(name, model_path, tmp_path), GOLDEN[name], metric_rel=1e-5, grad_rel=1e-6)
