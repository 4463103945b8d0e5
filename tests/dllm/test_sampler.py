"""LLaDA block sampler: fixed positions, commit schedule, block order, seeds, Gumbel-max."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import BlockRefinementScheduler

from mmpo.dllm.sampler import SamplerConfig, generate, gumbel_max_sample, row_transfer_schedule

MASK = 1
PROMPT_LEN = 3


def _prompt(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 5, 6], [4, 5, 6], [7, 8, 9]])[:batch]
    attention = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])[:batch]
    return ids, attention


def _hints(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    fixed = torch.zeros(batch, length, dtype=torch.bool)
    fixed[0, [1, 2, 9]] = True  # two hints in block 0, one in block 2 (block length 4)
    fixed[1, [4, 5, 6, 7]] = True  # block 1 fully hinted
    tokens = torch.full((batch, length), 0)
    tokens[fixed] = 10
    return tokens, fixed


def test_hint_positions_never_change_and_are_excluded_from_the_schedule(toy_model):
    config = SamplerConfig(gen_length=12, block_length=4, steps=6, temperature=1.0)  # 3 blocks x 2 steps
    prompt, attention = _prompt()
    tokens, fixed = _hints(3, 12)
    out = generate(toy_model, prompt, attention, config, mask_token_id=MASK, fixed_tokens=tokens, fixed_mask=fixed,
                   generator=torch.Generator().manual_seed(0))
    # Every intermediate canvas keeps the hint tokens at their positions.
    for canvas in toy_model.calls:
        assert torch.equal(canvas[:, PROMPT_LEN:][fixed], tokens[fixed])
    assert torch.equal(out.completions[fixed], tokens[fixed])
    assert torch.equal(out.fixed_mask, fixed)
    assert not (out.completions == MASK).any()
    # Commits per step: row 0 block 0 has 4 - 2 hints = 2 masked -> 1 + 1; block 1: 4 -> 2 + 2;
    # block 2: 4 - 1 = 3 -> 2 + 1 (remainder first). Row 1 block 1 is all hints -> 0 + 0.
    assert out.commits[:, 0].tolist() == [1, 1, 2, 2, 2, 1]
    assert out.commits[:, 1].tolist() == [2, 2, 0, 0, 2, 2]
    assert out.commits[:, 2].tolist() == [2, 2, 2, 2, 2, 2]
    assert out.committed_block.tolist() == [0, 0, 1, 1, 2, 2]


def test_blocks_are_decoded_left_to_right(toy_model):
    config = SamplerConfig(gen_length=12, block_length=4, steps=12, temperature=1.0)  # one token per step
    prompt, attention = _prompt()
    generate(toy_model, prompt, attention, config, mask_token_id=MASK, generator=torch.Generator().manual_seed(1))
    assert len(toy_model.calls) == 12
    for step, canvas in enumerate(toy_model.calls):
        block = step // 4
        completion = canvas[:, PROMPT_LEN:]
        # Before step `step`, earlier blocks are complete and later blocks untouched.
        assert not (completion[:, : block * 4] == MASK).any()
        assert (completion[:, (block + 1) * 4 :] == MASK).all()
        assert ((completion[:, block * 4 : (block + 1) * 4] == MASK).sum(1) == 4 - step % 4).all()
        assert torch.equal(canvas[:, :PROMPT_LEN], prompt)  # the prompt is never touched


def test_same_seed_same_output_and_greedy_is_deterministic(toy_model):
    config = SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=1.2)
    prompt, attention = _prompt()
    a = generate(toy_model, prompt, attention, config, mask_token_id=MASK, generator=torch.Generator().manual_seed(3))
    b = generate(toy_model, prompt, attention, config, mask_token_id=MASK, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.completions, b.completions)
    outs = {tuple(generate(toy_model, prompt, attention, config, mask_token_id=MASK,
                           generator=torch.Generator().manual_seed(s)).completions.flatten().tolist()) for s in range(6)}
    assert len(outs) > 1  # different seeds explore
    greedy = SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.0)
    g1 = generate(toy_model, prompt, attention, greedy, mask_token_id=MASK, generator=torch.Generator().manual_seed(1))
    g2 = generate(toy_model, prompt, attention, greedy, mask_token_id=MASK, generator=torch.Generator().manual_seed(2))
    assert torch.equal(g1.completions, g2.completions)


def test_low_confidence_remasking_commits_the_most_confident_position_first():
    class Peaked(torch.nn.Module):
        """Position 2 of the completion is certain, the others uniform."""

        def forward(self, input_ids, attention_mask=None):
            logits = torch.zeros(*input_ids.shape, 6)
            logits[:, 1 + 2, 4] = 50.0  # prompt length 1 -> completion position 2
            from types import SimpleNamespace

            return SimpleNamespace(logits=logits)

    config = SamplerConfig(gen_length=4, block_length=4, steps=4, temperature=0.0)
    captured = []
    model = Peaked()
    original = model.forward
    model.forward = lambda input_ids, attention_mask=None: (captured.append(input_ids.clone()), original(input_ids))[1]
    generate(model, torch.tensor([[3]]), torch.tensor([[1]]), config, mask_token_id=MASK)
    # After the first step only completion position 2 has been committed, with token 4.
    assert captured[1][0, 1:].tolist() == [MASK, MASK, 4, MASK]


def test_schedule_matches_diffusers_even_split():
    scheduler = BlockRefinementScheduler(block_length=8, num_inference_steps=3)
    schedule = row_transfer_schedule(torch.tensor([8, 5, 0]), 3, scheduler)
    # 8 = 3 + 3 + 2, 5 = 2 + 2 + 1, 0 = 0 + 0 + 0 (LLaDA's get_num_transfer_tokens: remainder first).
    assert schedule.tolist() == [[3, 3, 2], [2, 2, 1], [0, 0, 0]]


def test_gumbel_max_samples_softmax_at_temperature():
    logits = torch.log(torch.tensor([1.0, 2.0, 5.0]))  # softmax = [1/8, 2/8, 5/8]
    tau = 2.0  # softmax(logits / 2) ∝ sqrt([1, 2, 5]) = [1, 1.414, 2.236] / 4.650
    draws = gumbel_max_sample(logits.expand(40000, 3), tau, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).double() / 40000
    expected = torch.tensor([1.0, math.sqrt(2), math.sqrt(5)], dtype=torch.float64)
    expected /= expected.sum()
    assert torch.allclose(freq, expected, atol=0.01)
    assert gumbel_max_sample(logits, 0.0).item() == 2


def test_bad_settings_fail_clearly(toy_model):
    with pytest.raises(ValueError, match="multiple of block_length"):
        SamplerConfig(gen_length=10, block_length=4, steps=4)
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        SamplerConfig(gen_length=8, block_length=4, steps=3)
    prompt, attention = _prompt()
    fixed = torch.zeros(3, 8, dtype=torch.bool)
    fixed[0, 0] = True
    with pytest.raises(ValueError, match="fixed_tokens"):
        generate(toy_model, prompt, attention, SamplerConfig(gen_length=8, block_length=4, steps=4), mask_token_id=MASK,
                 fixed_mask=fixed)
