"""Backward-compatibility: advantages, losses and gradients on a committed tiny batch.

Regenerate the artifact with ``python tests/core/golden/make_golden.py`` only when a formula
is meant to change.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

GOLDEN_DIR = Path(__file__).parent / "golden"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOLDEN = json.loads((GOLDEN_DIR / "core_golden.json").read_text())
CURRENT = _load_generator().compute(GOLDEN["inputs"])


@pytest.mark.parametrize("name", sorted(GOLDEN["outputs"]["advantages"]))
def test_advantages_match_golden(name):
    assert torch.allclose(
        torch.tensor(CURRENT["advantages"][name]), torch.tensor(GOLDEN["outputs"]["advantages"][name]), atol=1e-10
    )


@pytest.mark.parametrize("key", sorted(GOLDEN["outputs"]["losses"]))
def test_losses_and_gradients_match_golden(key):
    golden, current = GOLDEN["outputs"]["losses"][key], CURRENT["losses"][key]
    assert current["loss"] == pytest.approx(golden["loss"], rel=1e-10, abs=1e-12)
    assert torch.allclose(torch.tensor(current["grad"]), torch.tensor(golden["grad"]), atol=1e-10)


def test_every_registered_name_has_a_golden_entry():
    from mmpo.core import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, POLICY_LOSSES

    assert sorted(GOLDEN["outputs"]["advantages"]) == ADVANTAGE_ESTIMATORS.names()
    expected = sorted(f"{n}/{a}" for n in POLICY_LOSSES.names() for a in AGGREGATION_MODES)
    assert sorted(GOLDEN["outputs"]["losses"]) == expected
