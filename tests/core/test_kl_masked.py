"""KL estimators and masked helpers: hand values and clamps."""

import math

import pytest
import torch

from mmpo.core import kl_penalty, masked_mean, masked_sum, masked_var, masked_whiten


def test_kl_hand_values():
    log_probs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    # token 0: l - l_ref = 1 ; token 1: l - l_ref = -1
    assert kl_penalty(log_probs, ref, "k1").tolist() == [[1.0, -1.0]]
    assert kl_penalty(log_probs, ref, "k2").tolist() == [[0.5, 0.5]]
    k3 = kl_penalty(log_probs, ref, "k3")
    # token 0: exp(-1) - (-1) - 1 = 0.367879 ; token 1: exp(1) - 1 - 1 = 0.718282
    assert k3[0, 0].item() == pytest.approx(math.exp(-1), rel=1e-6)
    assert k3[0, 1].item() == pytest.approx(math.e - 2, rel=1e-6)


def test_k3_clamps():
    log_probs = torch.tensor([[0.0, -50.0, -1.0]])
    ref = torch.tensor([[-50.0, 0.0, -1.5]])
    k3 = kl_penalty(log_probs, ref, "k3")
    # token 0: l_ref - l = -50 -> clamp -20 -> exp(-20) + 20 - 1 = 19.000000002 -> clamp 10
    # token 1: l_ref - l = +50 -> clamp 20 -> exp(20) - 21 -> clamp 10
    assert k3[0, :2].tolist() == [10.0, 10.0]
    wide = kl_penalty(log_probs, ref, "k3", inner_clamp=20.0, output_clamp=100.0)
    assert wide[0, 0].item() == pytest.approx(math.exp(-20) + 19, rel=1e-6)
    # token 2: l_ref - l = -0.5 -> exp(-0.5) + 0.5 - 1 = 0.106531
    assert k3[0, 2].item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-6)


def test_k3_gradient_and_errors():
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    kl_penalty(log_probs, torch.tensor([[-2.0]]), "k3").sum().backward()
    # d/dl [exp(l_ref - l) - (l_ref - l) - 1] = -exp(l_ref - l) + 1 = 1 - e^-1
    assert log_probs.grad.item() == pytest.approx(1 - math.exp(-1), rel=1e-6)
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4'.*'k1', 'k2', 'k3'"):
        kl_penalty(log_probs, log_probs, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), "k1")


def test_masked_helpers_hand_values():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(values, mask).item() == 6.0
    assert masked_mean(values, mask).item() == 2.0
    assert masked_mean(values, mask, dim=-1).tolist() == [1.5, 3.0]
    # unbiased var of (1, 2, 3) = 1 ; population var = 2/3
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    whitened = masked_whiten(values, mask, eps=0.0)
    # (x - 2) / 1 -> -1, 0, 1 ; masked-out positions 0
    assert torch.allclose(whitened, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    scaled = masked_whiten(values, mask, shift_mean=False, eps=0.0)
    assert torch.allclose(scaled, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
