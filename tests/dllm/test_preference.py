"""The DPO loss of mmpo.core on a masked-diffusion LM's sequence log-probs (one-pass estimator)."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.dllm.preference import sequence_log_probs
from mmpo.core import inpo_loss, preference_loss

MASK = 1


def _pairs():
    prompt = torch.tensor([[5, 6, 7], [8, 9, 3]])
    attention = torch.ones_like(prompt)
    chosen = torch.tensor([[4, 5, 2, 0], [6, 2, 0, 0]])
    rejected = torch.tensor([[9, 9, 9, 2], [3, 3, 2, 0]])
    chosen_mask = (torch.arange(4) < torch.tensor([[3], [2]])).long()
    rejected_mask = (torch.arange(4) < torch.tensor([[4], [3]])).long()
    return prompt, attention, chosen, chosen_mask, rejected, rejected_mask


def test_sequence_log_probs_sum_the_estimator_over_the_mask(toy_model):
    prompt, attention, chosen, chosen_mask, _, _ = _pairs()
    logps = sequence_log_probs(toy_model, prompt, attention, chosen, chosen_mask, mask_token_id=MASK)
    # by hand: the toy model's logits on [prompt | MASK x 4], log-softmax, gather, masked sum
    inputs = torch.cat([prompt, torch.full_like(chosen, MASK)], 1)
    logits = toy_model(inputs, torch.ones_like(inputs)).logits[:, 3:]
    per_token = logits.log_softmax(-1).gather(-1, chosen[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, (per_token * chosen_mask).sum(-1))


def test_dpo_on_the_masked_diffusion_lm_starts_at_log2_and_learns(toy_model):
    prompt, attention, chosen, chosen_mask, rejected, rejected_mask = _pairs()

    def both():
        return (sequence_log_probs(toy_model, prompt, attention, chosen, chosen_mask, mask_token_id=MASK),
                sequence_log_probs(toy_model, prompt, attention, rejected, rejected_mask, mask_token_id=MASK))

    with torch.no_grad():
        ref_chosen, ref_rejected = both()
    loss, metrics = preference_loss("sigmoid", *both(), ref_chosen, ref_rejected, beta=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # policy == reference: -log sigma(0)
    optimizer = torch.optim.SGD(toy_model.parameters(), lr=1.0)
    for _ in range(20):
        optimizer.zero_grad()
        loss, metrics = preference_loss("sigmoid", *both(), ref_chosen, ref_rejected, beta=0.5)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * math.log(2)
    assert metrics["rewards/accuracies"] == 1.0
    # INPO runs on the same log-probs (previous iterate = reference here: h = margin / 1)
    chosen_lp, rejected_lp = both()
    value, inpo_metrics = inpo_loss(chosen_lp, rejected_lp, ref_chosen, ref_rejected, ref_chosen, ref_rejected,
                                    eta=0.5, tau=1.0)
    margin = (chosen_lp - ref_chosen) - (rejected_lp - ref_rejected)
    assert value.item() == pytest.approx(float(((margin - 0.25) ** 2).mean()), rel=1e-5)
