"""One-pass log-prob estimator (d1 / IGPO): full completion masking, optional prompt masking."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mmpo.dllm.logprobs import completion_log_probs, perturb_for_scoring

MASK = 1


class TableModel(torch.nn.Module):
    """logits[b, j] = table[j]: the prediction depends only on the position."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)
        self.seen: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None):
        self.seen.append(input_ids.clone())
        return SimpleNamespace(logits=self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1))


def test_estimator_equals_hand_computed_log_softmax_gather():
    # Prompt length 2, completion length 2, vocab 3.
    # Completion position 0: logits log([1, 2, 3]) -> softmax [1/6, 2/6, 3/6];
    # completion position 1: logits [0, 0, log 2]   -> softmax [1/4, 1/4, 2/4].
    table = torch.tensor(
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3)], [0.0, 0.0, math.log(2)]]
    )
    model = TableModel(table)
    prompt = torch.tensor([[2, 0]])
    attention = torch.ones_like(prompt)
    completion = torch.tensor([[2, 0]])
    log_probs, entropy = completion_log_probs(model, prompt, attention, completion, mask_token_id=MASK, with_entropy=True)
    assert torch.allclose(log_probs, torch.tensor([[math.log(3 / 6), math.log(1 / 4)]]), atol=1e-6)
    # H = -sum p log p: position 0 over [1/6, 2/6, 3/6], position 1 over [1/4, 1/4, 1/2].
    h0 = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))
    h1 = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    assert torch.allclose(entropy, torch.tensor([[h0, h1]]), atol=1e-6)
    # The model saw the prompt and a fully masked completion.
    assert model.seen[0].tolist() == [[2, 0, MASK, MASK]]


def test_estimator_matches_manual_gather_on_a_real_tiny_model(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompt = torch.tensor([[5, 6, 7], [0, 8, 9]])
    attention = torch.tensor([[1, 1, 1], [0, 1, 1]])
    completion = torch.tensor([[4, 5, 2, 2], [6, 2, 2, 2]])
    mask_id = tokenizer.mask_token_id
    log_probs, _ = completion_log_probs(model, prompt, attention, completion, mask_token_id=mask_id)
    inputs = torch.cat([prompt, torch.full_like(completion, mask_id)], 1)
    logits = model(input_ids=inputs, attention_mask=torch.cat([attention, torch.ones_like(completion)], 1)).logits[:, 3:]
    manual = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
    assert torch.allclose(log_probs, manual, atol=1e-5)


def test_prompt_masking_is_seeded_and_spares_padding():
    prompt = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9]] * 4)
    attention = (prompt != 0).long()
    completion = torch.tensor([[3, 4]] * 4)
    a, _, _ = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, p_mask_prompt=0.5, seed=7)
    b, _, _ = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, p_mask_prompt=0.5, seed=7)
    c, _, _ = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, p_mask_prompt=0.5, seed=8)
    assert torch.equal(a, b)  # old and new log-probs of one inner step see the same masked prompt
    assert not torch.equal(a, c)
    assert (a[:, :2] == 0).all()  # padding is never masked
    assert (a[:, -2:] == MASK).all()  # the completion is always fully masked
    assert 0 < (a[:, 2:12] == MASK).float().mean() < 1
    unmasked, _, _ = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, p_mask_prompt=0.0, seed=7)
    assert torch.equal(unmasked[:, :12], prompt)  # IGPO: the prompt stays visible


def test_structured_timesteps_follow_igpos_schedule():
    from mmpo.dllm.logprobs import structured_timesteps

    generator = torch.Generator().manual_seed(0)
    steps = structured_timesteps(4, 128, 30, generator)
    t0 = steps[0]
    assert 30 <= t0 <= 126
    # t_n = floor(n / (mu - 1) * (T - t0) + t0): evenly spaced up to T
    assert steps == [t0] + [int(n / 3 * (128 - t0) + t0) for n in (1, 2, 3)] and steps[-1] == 128
    assert structured_timesteps(1, 128, 30, torch.Generator().manual_seed(0)) == [t0]
    # hand-computed for a fixed t0: T = 10, min = max = 8 -> [8, 9, 10]
    assert structured_timesteps(3, 10, 8) == [8, 9, 10]
    with pytest.raises(ValueError):
        structured_timesteps(2, 10, 9)


def test_partial_completion_masking_is_seeded_and_scores_the_masked_positions(toy_model):
    prompt = torch.tensor([[3, 4, 5]])
    attention = torch.ones_like(prompt)
    completion = torch.tensor([[6, 7, 8, 9, 10, 11, 6, 7, 8, 9]])
    ids, _, masked = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, completion_mask_ratio=0.5, seed=3)
    again, _, masked_again = perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, completion_mask_ratio=0.5, seed=3)
    assert torch.equal(ids, again) and torch.equal(masked, masked_again)
    assert 0 < int(masked.sum()) < completion.numel()
    assert torch.equal(ids[:, 3:][masked], torch.full((int(masked.sum()),), MASK))
    assert torch.equal(ids[:, 3:][~masked], completion[~masked])  # unmasked tokens stay visible
    assert torch.equal(ids[:, :3], prompt)
    log_probs, _ = completion_log_probs(toy_model, prompt, attention, completion, mask_token_id=MASK,
                                        completion_mask_ratio=0.5, seed=3)
    expected = torch.log_softmax(toy_model(ids).logits[:, 3:], -1).gather(-1, completion[..., None])[..., 0]
    assert torch.allclose(log_probs, expected)
    with pytest.raises(ValueError):
        perturb_for_scoring(prompt, attention, completion, mask_token_id=MASK, completion_mask_ratio=0.0)
