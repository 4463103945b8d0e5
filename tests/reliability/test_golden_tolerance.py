"""The per-family golden comparison (tests/golden_support.py) absorbs another processor's rounding of a
cancelling gradient sum but not a formula-sized change: values from the 2026-12-01 measurement."""

import pytest
from golden_support import assert_step_matches

# lm_head gradient fingerprint [sum, sum of squares, projection] as the artifact's machine wrote it; the
# sum cancels to ~1e-7 over the vocabulary while the norm is ~0.39
GOLDEN = {"metrics": {"losses/kl": 0.12054892629384995},
          "grad": {"lm_head.weight": [1.7768971580234272e-07, 0.1521, -0.0133]}}


def _current(kl: float, grad: list[float]) -> dict:
    return {"metrics": {"losses/kl": kl, "new/metric": 1.0}, "grad": {"lm_head.weight": grad}}


def test_another_processors_rounding_passes():
    # measured on an AVX-512 machine: the sum moved by 59% of itself, the KL by 1.2e-7 relative
    assert_step_matches(_current(0.12054891139268875, [7.291627965311243e-08, 0.1521, -0.0133]), GOLDEN,
                        metric_rel=1e-5, grad_rel=2e-6)


@pytest.mark.parametrize("current", [
    _current(0.1206, [1.7768971580234272e-07, 0.1521, -0.0133]),      # KL moved by 5e-4 relative
    _current(0.12054892629384995, [1.7768971580234272e-07, 0.1525, -0.0133]),  # sum of squares moved
    _current(0.12054892629384995, [2e-05, 0.1521, -0.0133]),          # sum moved by 5e-5 of the norm 0.39
])
def test_a_formula_sized_change_fails(current):
    with pytest.raises(AssertionError):
        assert_step_matches(current, GOLDEN, metric_rel=1e-5, grad_rel=2e-6)


def test_machine_line_names_processor_simd_level_and_torch():
    from mmpo.training.machine import cpu_fingerprint, describe_machine

    assert describe_machine({"cpu": "AMD EPYC 7B13", "isa": "AVX2", "torch": "2.14.1"}) == "AMD EPYC 7B13, AVX2, torch 2.14.1"
    assert sorted(cpu_fingerprint()) == ["cpu", "isa", "torch"]
