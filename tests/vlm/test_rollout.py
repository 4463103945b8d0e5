"""HF-generate rollouts and completion log-probs on the tiny Qwen2.5-VL."""

from __future__ import annotations

import pytest
import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_log_probs, sequence_inputs
from mmpo.vlm.processing import encode_prompts, model_inputs
from mmpo.vlm.rollout import HFGenerateEngine, completion_mask_from_ids, concat_rollouts

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350)
    return load_vlm(path)


def _rows():
    return make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)


def test_completion_mask_hand_computed():
    eos, pad, image_pad = 2, 0, 5
    ids = torch.tensor([[7, 8, eos, pad], [7, image_pad, 9, 9], [eos, 7, eos, 7]])
    mask = completion_mask_from_ids(ids, eos_token_id=eos, forbidden_ids=[image_pad])
    # row 0: up to and including EOS; row 1: the image pad ends it; row 2: the first EOS ends it
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    no_eos = completion_mask_from_ids(torch.tensor([[7, 8, 9]]), eos_token_id=[eos, 3])
    assert no_eos.tolist() == [[1, 1, 1]]


def test_generate_groups_samples_contiguously(tiny):
    model, processor = tiny
    rows = _rows()
    torch.manual_seed(0)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=3, max_new_tokens=5, temperature=1.0)
    assert len(rollout) == 9
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["id"] for r in rollout.rows] == [r["id"] for r in rows for _ in range(3)]
    assert rollout.completion_ids.shape == rollout.completion_mask.shape == (9, 5)
    assert rollout.prompt_inputs["input_ids"].shape[0] == 9
    assert rollout.prompt_inputs["image_counts"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert len(rollout.texts) == 9
    # samples of one prompt differ (temperature 1 on a random model)
    assert len({tuple(x) for x in rollout.completion_ids[:3].tolist()}) > 1
    assert not model.training
    sub = rollout.select([3, 8])
    assert sub.group_ids.tolist() == [1, 2] and sub.rows[1]["id"] == rows[2]["id"]
    assert torch.equal(sub.completion_ids, rollout.completion_ids[[3, 8]])
    assert sub.prompt_inputs["pixel_values"].shape[0] == 16


def test_log_probs_reproduce_the_sampling_distribution(tiny):
    """The training forward on [prompt | completion] gives the log-probs generate sampled from."""
    model, processor = tiny
    rows = _rows()
    temperature = 0.7
    torch.manual_seed(1)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=6, temperature=temperature)
    inputs = model_inputs(encode_prompts(processor, rows))
    torch.manual_seed(1)
    out = model.generate(
        **inputs, max_new_tokens=6, num_return_sequences=2, do_sample=True, temperature=temperature, top_k=0,
        top_p=1.0, return_dict_in_generate=True, output_logits=True,
        eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id,
    )
    mask = rollout.completion_mask.bool()
    width = rollout.completion_ids.shape[1]
    assert torch.equal(out.sequences[:, -width:][mask], rollout.completion_ids[mask])
    gen_logits = torch.stack(out.logits, 1)[:, :width].float() / temperature
    expected = torch.log_softmax(gen_logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        log_probs, entropy = completion_log_probs(
            model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask,
            temperature=temperature, with_entropy=True, chunk_size=7,
        )
    assert log_probs.shape == entropy.shape == (6, width)
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-4, rtol=1e-4)
    probs = torch.softmax(gen_logits, -1)
    expected_entropy = -(probs * torch.log_softmax(gen_logits, -1)).sum(-1)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-4, rtol=1e-4)


def test_log_probs_do_not_depend_on_left_padding(tiny):
    model, processor = tiny
    rows = _rows()
    torch.manual_seed(2)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=1, max_new_tokens=4)
    with torch.no_grad():
        batched, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
        for i in range(3):
            single = rollout.select([i])
            width = int(single.prompt_inputs["attention_mask"].sum())
            single.prompt_inputs["input_ids"] = single.prompt_inputs["input_ids"][:, -width:]
            single.prompt_inputs["attention_mask"] = single.prompt_inputs["attention_mask"][:, -width:]
            single.prompt_inputs["mm_token_type_ids"] = single.prompt_inputs["mm_token_type_ids"][:, -width:]
            alone, _ = completion_log_probs(model, single.prompt_inputs, single.completion_ids, single.completion_mask)
            mask = single.completion_mask[0].bool()
            torch.testing.assert_close(batched[i][mask], alone[0][mask], atol=1e-5, rtol=1e-5)


def test_generated_vision_tokens_are_masked_and_safe_to_score(tiny):
    """A policy that emits <|image_pad|> must not crash the scoring forward (R1-V#91)."""
    model, processor = tiny
    image_pad = processor.image_token_id
    head = model.get_output_embeddings()
    # an output layer whose bias makes <|image_pad|> the argmax everywhere
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[image_pad] = 1e4
    try:
        model.set_output_embeddings(biased)
        rollout = HFGenerateEngine(model, processor).generate(
            _rows()[:1], num_samples=2, max_new_tokens=3, do_sample=False
        )
        assert rollout.completion_mask.sum() == 0
        assert (rollout.completion_ids == processor.tokenizer.pad_token_id).all()
        with torch.no_grad():
            log_probs, _ = completion_log_probs(
                model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask
            )
        assert torch.isfinite(log_probs).all()
    finally:
        model.set_output_embeddings(head)


def test_sequence_inputs_extend_masks_and_token_types(tiny):
    model, processor = tiny
    prompts = encode_prompts(processor, _rows()[:1])
    completion = torch.tensor([[11, 12, 0]])
    mask = torch.tensor([[1, 1, 0]])
    inputs = sequence_inputs(prompts, completion, mask)
    width = prompts["input_ids"].shape[1]
    assert inputs["input_ids"][0, width:].tolist() == [11, 12, 0]
    assert inputs["attention_mask"][0, width:].tolist() == [1, 1, 0]
    assert inputs["mm_token_type_ids"][0, width:].tolist() == [0, 0, 0]
    assert torch.equal(inputs["pixel_values"], prompts["pixel_values"])


def test_concat_rollouts_renumbers_groups(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    torch.manual_seed(3)
    a = engine.generate(_rows()[:1], num_samples=2, max_new_tokens=3)
    b = engine.generate(_rows()[2:], num_samples=2, max_new_tokens=5)
    a.extras.update(step=5, per_token=torch.ones(2, 3), per_sample=torch.tensor([1, 2]))
    b.extras.update(step=5, per_token=torch.full((2, 5), 2.0), per_sample=torch.tensor([3, 4]))
    both = concat_rollouts([a, b])
    assert both.extras["step"] == 5
    assert both.extras["per_sample"].tolist() == [1, 2, 3, 4]
    assert both.extras["per_token"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [2] * 5, [2] * 5]
    assert both.group_ids.tolist() == [0, 0, 1, 1]
    assert both.completion_ids.shape == (4, 5)
    assert torch.equal(both.completion_ids[:2, :3], a.completion_ids)
    assert both.completion_mask[:2, 3:].sum() == 0
    with torch.no_grad():
        joint, _ = completion_log_probs(model, both.prompt_inputs, both.completion_ids, both.completion_mask)
        alone, _ = completion_log_probs(model, b.prompt_inputs, b.completion_ids, b.completion_mask)
    mask = b.completion_mask.bool()
    torch.testing.assert_close(joint[2:][mask], alone[mask], atol=1e-5, rtol=1e-5)


def test_bad_sampling_settings_are_refused(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    with pytest.raises(ValueError, match="num_samples"):
        engine.generate(_rows(), num_samples=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(_rows(), num_samples=2, max_new_tokens=2, temperature=0.0)
