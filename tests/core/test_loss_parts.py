"""LossParts: named loss terms with coefficients, summed in one place, logged unweighted."""

import pytest
import torch

from mmpo.core import LossParts, as_loss_parts


def test_total_is_the_coefficient_weighted_sum_and_metrics_are_unweighted():
    policy = torch.tensor(0.5, requires_grad=True)
    kl = torch.tensor(2.0, requires_grad=True)
    parts = LossParts().add("policy", policy).add("kl", kl, 0.1).add("entropy", torch.tensor(3.0), -0.01)
    total = parts.total()
    assert total.item() == pytest.approx(0.5 + 0.1 * 2.0 - 0.01 * 3.0)
    total.backward()
    assert policy.grad.item() == 1.0 and kl.grad.item() == pytest.approx(0.1)
    assert {k: v.item() for k, v in parts.metrics().items()} == {
        "losses/policy": 0.5, "losses/kl": 2.0, "losses/entropy": 3.0}
    assert list(parts) == ["policy", "kl", "entropy"] and parts["kl"] is kl
    assert parts.weighted("kl").item() == pytest.approx(0.2)


def test_a_switched_off_part_is_logged_but_never_summed():
    parts = LossParts().add("policy", torch.tensor(1.5)).add("entropy", torch.tensor(float("nan")), 0.0)
    assert parts.total().item() == 1.5  # a NaN term with coefficient 0 cannot poison the loss
    assert torch.isnan(parts.metrics()["losses/entropy"])


def test_names_are_unique_and_terms_scalar():
    parts = LossParts().add("policy", torch.tensor(1.0))
    with pytest.raises(ValueError, match="duplicate loss part 'policy'"):
        parts.add("policy", torch.tensor(2.0))
    with pytest.raises(ValueError, match="duplicate loss part 'policy'"):
        LossParts().add("policy", 0.0).update_from(parts)
    with pytest.raises(ValueError, match="must be a 0-d tensor"):
        parts.add("kl", torch.ones(2))
    with pytest.raises(ValueError, match="no loss parts"):
        LossParts().total()
    assert LossParts().add("kl", float("inf"), 0.0).total().item() == 0.0  # all switched off


def test_hook_results_become_parts():
    assert list(as_loss_parts(torch.tensor(2.0))) == ["extra"]
    mapped = as_loss_parts({"a": torch.tensor(1.0), "b": 2.0})
    assert mapped.total().item() == 3.0 and mapped.coefficient("b") == 1.0
    parts = LossParts().add("x", 1.0, 3.0)
    assert as_loss_parts(parts) is parts
