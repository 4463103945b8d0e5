"""LLaDA SFT loss and forward process."""

from __future__ import annotations

import math

import pytest
import torch

from dllm.sft import llada_sft_loss, sft_forward_process


def test_llada_sft_loss_hand_computed():
    # Vocab 2, answer length 2. Row 0: uniform logits, token 0 masked, p = 0.5:
    #   CE = log 2, loss_0 = log 2 / 0.5 / 2 = log 2.
    # Row 1: logits [log 3, 0] -> p(token 0) = 3/4; both tokens masked (both 0), p = 0.25:
    #   CE = -log(3/4) each, loss_1 = 2 * log(4/3) / 0.25 / 2 = 4 log(4/3).
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[math.log(3), 0.0], [math.log(3), 0.0]]])
    answers = torch.tensor([[0, 1], [0, 0]])
    masked = torch.tensor([[True, False], [True, True]])
    p_mask = torch.tensor([0.5, 0.25])
    loss = llada_sft_loss(logits, answers, masked, p_mask)
    expected = (math.log(2) + 4 * math.log(4 / 3)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_forward_process_masks_with_the_drawn_ratio():
    answers = torch.full((400, 50), 7)
    noisy, masked, p_mask = sft_forward_process(answers, 1, eps=1e-3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(noisy == 1, masked)
    assert bool(((p_mask >= 1e-3) & (p_mask <= 1.0)).all())
    # Per row, the masked fraction tracks p (50 Bernoulli draws: std <= 0.071).
    assert (masked.float().mean(1) - p_mask).abs().mean() < 0.06
    # Unmasked tokens keep their value.
    assert (noisy[~masked] == 7).all()
