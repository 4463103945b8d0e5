"""LLaDA SFT loss and forward process."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.dllm.sft import llada_sft_loss, sft_forward_process


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


def test_sft_steps_lower_the_loss_on_fixed_traces(tiny_model_and_tokenizer):
    """Learning direction: 60 AdamW steps on 16 traces reduce the LLaDA loss at fixed mask draws."""
    import copy

    from mmpo.dllm.modeling import encode_completions, encode_prompts
    from mmpo.dllm.task import ArithmeticTaskConfig, make_split

    model, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(model).train()
    rows = make_split(ArithmeticTaskConfig(), 16, seed=3)
    prompt, attention = encode_prompts(tokenizer, [r["problem"] for r in rows])
    answers = encode_completions(tokenizer, [r["trace"] for r in rows], 24)

    def loss_at(seed: int) -> torch.Tensor:
        noisy, masked, p_mask = sft_forward_process(answers, tokenizer.mask_token_id, generator=torch.Generator().manual_seed(seed))
        logits = model(input_ids=torch.cat([prompt, noisy], 1),
                       attention_mask=torch.cat([attention, torch.ones_like(noisy)], 1)).logits[:, prompt.shape[1]:]
        return llada_sft_loss(logits, answers, masked, p_mask)

    with torch.no_grad():
        before = sum(loss_at(1000 + s).item() for s in range(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        optimizer.zero_grad()
        loss_at(step).backward()
        optimizer.step()
    with torch.no_grad():
        after = sum(loss_at(1000 + s).item() for s in range(4))
    assert after < 0.85 * before
