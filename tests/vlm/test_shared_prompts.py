"""The training forward runs each distinct prompt once (mmpo.vlm.shared_prompts): the same hidden states,
log-probs and gradients as running every [prompt | completion] row in full."""

from __future__ import annotations

import pytest
import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_hidden_states, completion_log_probs
from mmpo.vlm.processing import encode_prompts, select_rows
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.shared_prompts import distinct_prompt_rows
from tiny_vlm_support import tiny_qwen3_vl_config

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_vlm(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350))


@pytest.fixture(scope="module")
def rollout(tiny):
    model, processor = tiny
    # two image prompts with the same question text but different images, and a text-only prompt
    rows = make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)
    rows[1] = {**rows[1], "problem": rows[0]["problem"]}
    torch.manual_seed(0)
    return HFGenerateEngine(model, processor).generate(rows, num_samples=3, max_new_tokens=6)


def test_distinct_prompt_rows_compare_tokens_and_pixels(tiny, rollout):
    _model, processor = tiny
    shuffled = [4, 0, 8, 1, 3, 6]  # groups 1, 0, 2, 0, 1, 2 (3 completions per prompt)
    prompts = select_rows(rollout.prompt_inputs, shuffled)
    assert distinct_prompt_rows(prompts) == ([0, 1, 2], [0, 1, 2, 1, 0, 2])
    # rows 0 and 1 of the data share the question text: only their images tell them apart
    texts = encode_prompts(processor, [rollout.rows[0], rollout.rows[3]])
    assert torch.equal(texts["input_ids"][0], texts["input_ids"][1])
    assert distinct_prompt_rows(texts) == ([0, 1], [0, 1])
    assert distinct_prompt_rows({k: v for k, v in prompts.items() if k != "image_counts"}) is None


@pytest.mark.parametrize("order", [list(range(9)), [4, 0, 8, 1, 3, 6, 2, 7, 5]], ids=["grouped", "shuffled"])
def test_shared_prompt_forward_equals_the_full_forward_values_and_gradients(tiny, rollout, order):
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
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((hidden.detach(), grads))
    (shared, shared_grads), (full, full_grads) = results
    mask = part.completion_mask.bool()
    assert shared.shape == full.shape
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=0)
    assert shared_grads.keys() == full_grads.keys() and any("visual" in n for n in full_grads)
    for name, grad in full_grads.items():  # relative to each tensor's scale
        assert float((shared_grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name
    model.eval()


def test_shared_prompt_log_probs_run_the_prompt_once_per_distinct_prompt(tiny, rollout):
    model, _processor = tiny
    calls = []
    hook = model.model.language_model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True)
    try:
        with torch.no_grad():
            shared, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids,
                                             rollout.completion_mask)
    finally:
        hook.remove()
    width = rollout.prompt_inputs["input_ids"].shape[1]
    assert calls == [(3, width), (9, 5)]  # 3 distinct prompts once, then 9 rows x the first 5 completion tokens
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids,
                                          rollout.completion_mask, share_prompts=False)
        full = torch.log_softmax(model.get_output_embeddings()(hidden), -1)
    full = full.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=0)


def test_qwen3_vl_shared_prompts_keep_deepstack_features_with_their_image():
    """Qwen3-VL also injects per-image deepstack features into early decoder layers. A tiny random
    Qwen3-VL: rows 0-2 share a left-padded prompt with image A, row 3 has another prompt with image B."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = tiny_qwen3_vl_config()
    # float64: the two paths batch the image's rows differently, and in float32 the rounding of that reached
    # 1.1e-4 of a gradient's largest entry on an Intel AVX-512 machine (over the old 1e-4 tolerance); in float64
    # the largest is 2.5e-5 (some of Qwen3-VL's vision ops stay float32), so 1e-4 keeps a 4x margin
    model = Qwen3VLForConditionalGeneration(config).double().train()
    image_a, image_b = torch.randn(16, 96, dtype=torch.float64), torch.randn(16, 96, dtype=torch.float64)  # 1x4x4 grid
    ids = torch.tensor([[0, 5, 62, 60, 60, 60, 60, 63, 7, 8]] * 4)
    ids[3, 0] = 9
    mask = torch.ones_like(ids)
    mask[:3, 0] = 0  # rows 0-2 left-padded by one
    prompts = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == 60).long(),
                   pixel_values=torch.cat([image_a, image_a, image_a, image_b]),
                   image_grid_thw=torch.tensor([[1, 4, 4]] * 4), image_counts=torch.ones(4, dtype=torch.long))
    assert distinct_prompt_rows(prompts) == ([0, 3], [0, 0, 0, 1])
    completion = torch.randint(0, 50, (4, 3))
    results = []
    for share in (True, False):
        model.zero_grad()
        hidden = completion_hidden_states(model, prompts, completion, torch.ones_like(completion),
                                          share_prompts=share)
        hidden.pow(2).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (shared, shared_grads), (full, full_grads) = results
    torch.testing.assert_close(shared, full, atol=1e-6, rtol=0)
    assert shared_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        assert float((shared_grads[name] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()) + 1e-12, name


def test_gradient_checkpointing_falls_back_to_the_full_forward(tiny, rollout):
    """HF turns use_cache off in training under gradient checkpointing, so the prompt's cache would stay
    empty and the completions would see no prompt: the shared path must step aside (found by the FSDP2
    checkpointing test: 5% log-prob error before the fallback)."""
    import copy

    model, _processor = tiny
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    model.train()
    try:
        args = (rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
        got = completion_hidden_states(checkpointed, *args, share_prompts=True)
        expected = completion_hidden_states(model, *args, share_prompts=False)
        mask = rollout.completion_mask.bool()
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
    finally:
        model.eval()
