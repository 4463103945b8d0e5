"""The shared-prompt training forward on a text LM (mmpo.vlm.shared_prompts, issue 38): each distinct prompt
runs once, and hidden states, log-probs and gradients equal running every [prompt | completion] row in full,
with left-padded prompts of different lengths and groups in any order."""

from __future__ import annotations

import pytest
import torch

from tiny_vlm_support import build_small_text_lm

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_hidden_states, completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.shared_prompts import distinct_prompt_rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text")))


@pytest.fixture(scope="module")
def rollout(tiny):
    model, processor = tiny
    # prompts of different lengths: the shorter ones are left-padded in the batch
    rows = make_items("long_arithmetic", 1, seed=0) + make_items("word_problem", 1, seed=0) \
        + make_items("countdown", 1, seed=0)
    torch.manual_seed(0)
    return HFGenerateEngine(model, processor).generate(rows, num_samples=3, max_new_tokens=6)


def test_distinct_text_prompts_are_found_by_tokens_and_mask(rollout):
    prompts = rollout.prompt_inputs
    assert "pixel_values" not in prompts and int((prompts["attention_mask"] == 0).sum()) > 0  # left padding
    assert distinct_prompt_rows(prompts) == ([0, 3, 6], [0, 0, 0, 1, 1, 1, 2, 2, 2])


@pytest.mark.parametrize("order", [list(range(9)), [4, 0, 8, 1, 3, 6, 2, 7, 5]], ids=["grouped", "shuffled"])
def test_text_shared_prompt_forward_equals_the_full_forward(tiny, rollout, order):
    model, _processor = tiny
    part = rollout.select(order)
    model.train()
    results = []
    for share in (True, False):
        model.zero_grad()
        hidden = completion_hidden_states(model, part.prompt_inputs, part.completion_ids, part.completion_mask,
                                          share_prompts=share)
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
        (hidden * weights * part.completion_mask.unsqueeze(-1)).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.eval()
    (shared, shared_grads), (full, full_grads) = results
    mask = part.completion_mask.bool()
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=0)
    assert shared_grads.keys() == full_grads.keys() and len(full_grads) > 10
    for name, grad in full_grads.items():  # relative to each tensor's scale
        assert float((shared_grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name


def test_text_log_probs_run_each_prompt_once(tiny, rollout):
    model, _processor = tiny
    calls = []
    hook = model.model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        with torch.no_grad():
            shared, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids,
                                             rollout.completion_mask)
    finally:
        hook.remove()
    width = rollout.prompt_inputs["input_ids"].shape[1]
    completion_width = rollout.completion_ids.shape[1]
    assert calls == [(3, width), (9, completion_width - 1)]  # 3 distinct prompts once, then the 9 completions
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids,
                                          rollout.completion_mask, share_prompts=False)
        full = torch.log_softmax(model.get_output_embeddings()(hidden), -1)
    full = full.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=0)
