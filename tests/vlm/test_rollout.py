"""HF-generate rollouts and completion log-probs on the tiny Qwen2.5-VL."""

from __future__ import annotations

import pytest
import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_log_probs, sequence_inputs
from mmpo.vlm.processing import encode_prompts, model_inputs, repeat_rows, vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine, _cut_by, completion_mask_from_ids, concat_rollouts

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
        top_p=1.0, return_dict_in_generate=True, output_logits=True, suppress_tokens=vision_token_ids(processor),
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


def test_vision_token_ids_are_derived_from_the_processor(tiny):
    _model, processor = tiny
    tokenizer = processor.tokenizer
    expected = {tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>",
                                                             "<|image_pad|>", "<|video_pad|>")}
    assert set(vision_token_ids(processor)) == expected
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in vision_token_ids(processor)


@pytest.mark.parametrize("do_sample", [False, True])
def test_vision_tokens_are_never_sampled_even_when_the_model_prefers_them(tiny, do_sample):
    """An output layer whose bias makes the vision tokens take ~all the probability: suppression at
    sampling time still never draws one, so the guard never fires (vision_cut all False)."""
    model, processor = tiny
    forbidden = vision_token_ids(processor)
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[forbidden] = 30.0  # e^30 / vocab ~ 1e10: unsuppressed, a vision token is drawn every time
    try:
        model.set_output_embeddings(biased)
        engine = HFGenerateEngine(model, processor)
        torch.manual_seed(0)
        rollout = engine.generate(_rows(), num_samples=4, max_new_tokens=8, do_sample=do_sample,
                                  return_log_probs=True)
        with torch.no_grad():  # the unsuppressed policy really prefers them: > 0.99 at the first position
            inputs = model_inputs(encode_prompts(processor, _rows()[:1]))
            first = torch.softmax(model(**inputs).logits[0, -1], -1)
        assert float(first[forbidden].sum()) > 0.99
    finally:
        model.set_output_embeddings(head)
    assert not torch.isin(rollout.completion_ids, torch.tensor(forbidden)).any()
    assert rollout.completion_mask.sum() > 0
    assert rollout.extras["vision_cut"].tolist() == [False] * 12
    # the recorded sampler log-probs are those of the suppressed distribution: finite on real tokens
    assert torch.isfinite(rollout.extras["engine_log_probs"][rollout.completion_mask.bool()]).all()


def test_vision_guard_cut_is_counted_hand_computed():
    eos, pad, image_pad, vision_start = 2, 0, 5, 3
    ids = torch.tensor([[7, image_pad, 9], [7, eos, image_pad], [7, 8, 9], [vision_start, 7, 7], [7, 8, eos]])
    mask = completion_mask_from_ids(ids, eos_token_id=eos, forbidden_ids=[image_pad, vision_start])
    # row 0: cut at the image pad; row 1: EOS ended it first; row 2: no EOS, nothing cut;
    # row 3: cut at the first token; row 4: ended by EOS at the last position
    assert mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]]
    cut = _cut_by(ids, eos_token_id=eos, forbidden_ids=[image_pad, vision_start])
    assert cut.tolist() == [True, False, False, True, False]
    assert _cut_by(ids, eos_token_id=eos, forbidden_ids=[]).tolist() == [False] * 5


def test_guard_masked_vision_tokens_are_safe_to_score(tiny):
    """Should a vision token slip through, the guard's pad-and-mask makes scoring safe (R1-V#91)."""
    model, processor = tiny
    image_pad, pad = processor.image_token_id, processor.tokenizer.pad_token_id
    prompts = repeat_rows(encode_prompts(processor, _rows()[:1]), 2)
    ids = torch.tensor([[11, image_pad, 12], [image_pad, image_pad, 13]])
    mask = completion_mask_from_ids(ids, eos_token_id=processor.tokenizer.eos_token_id, forbidden_ids=[image_pad])
    ids = ids.masked_fill(mask == 0, pad)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, prompts, ids, mask)
    assert mask.tolist() == [[1, 0, 0], [0, 0, 0]]
    assert torch.isfinite(log_probs).all()


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


def test_concat_rollouts_names_an_extra_missing_from_a_later_rollout(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    torch.manual_seed(3)
    a = engine.generate(_rows()[:1], num_samples=2, max_new_tokens=3)
    b = engine.generate(_rows()[2:], num_samples=2, max_new_tokens=3)
    del a.extras["vision_cut"]  # the first rollout lacks it: still found (keys of every rollout are checked)
    with pytest.raises(ValueError, match=r"extras\['vision_cut'\] is missing from rollout\(s\) \[0\] of 2"):
        concat_rollouts([a, b])


def test_bad_sampling_settings_are_refused(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    with pytest.raises(ValueError, match="num_samples"):
        engine.generate(_rows(), num_samples=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(_rows(), num_samples=2, max_new_tokens=2, temperature=0.0)


# ----------------------------------------------------------------------------- one prefill per prompt


def _logits_both_paths(model, processor, rows, copies, **sampling):
    """(sequences, per-step logits) of the expanded path (every prompt repeated ``copies`` times, as
    HF's ``num_return_sequences`` expansion does) and of the engine's prefill-once path, each from
    the same seed, on the same prompts (images and a text-only row, left padded)."""
    engine = HFGenerateEngine(model, processor)
    prompts = encode_prompts(processor, rows)
    special = dict(eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id, use_cache=True)
    common = dict(max_new_tokens=7, return_dict_in_generate=True, output_logits=True, **special, **sampling)
    with torch.no_grad():
        torch.manual_seed(5)
        expanded = model.generate(**model_inputs(repeat_rows(prompts, copies)), **common)
        prefilled_inputs = engine._prefill(model_inputs(prompts), copies, special)
        torch.manual_seed(5)
        once = model.generate(**prefilled_inputs, **common)
    return expanded, once


@pytest.mark.parametrize("rows", ["images", "text"])
@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=0)],
                         ids=["greedy", "sampled"])
def test_prefill_once_gives_the_expanded_paths_log_probs(tiny, sampling, rows):
    """Images (with a text-only row) prefill by one forward with Qwen-VL's RoPE positions; a text-only
    batch through HF's generate (one greedy token)."""
    model, processor = tiny
    batch = _rows() if rows == "images" else make_items("arithmetic", 2, seed=1)
    expanded, once = _logits_both_paths(model, processor, batch, 3, **sampling)
    assert torch.equal(expanded.sequences, once.sequences)
    assert len(expanded.logits) == len(once.logits) == 7
    for a, b in zip(expanded.logits, once.logits):  # every row's next-token log-probs, at every step
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=1e-5, rtol=0)


def test_engine_prefill_once_samples_what_the_expanded_engine_samples(tiny):
    model, processor = tiny
    runs = []
    for prefill_once in (True, False):
        torch.manual_seed(2)
        runs.append(HFGenerateEngine(model, processor, prefill_once=prefill_once).generate(
            _rows(), num_samples=4, max_new_tokens=6, temperature=0.9, return_log_probs=True))
    once, expanded = runs
    assert torch.equal(once.completion_ids, expanded.completion_ids)
    assert torch.equal(once.completion_mask, expanded.completion_mask)
    assert len({tuple(x) for x in once.completion_ids[:4].tolist()}) > 1  # the G copies sample apart
    torch.testing.assert_close(once.extras["engine_log_probs"], expanded.extras["engine_log_probs"],
                               atol=1e-5, rtol=0)


def test_prefill_once_runs_each_prompt_through_the_decoder_once(tiny):
    """Token positions the text decoder processes: the prompt's P once per prompt (its last token per
    copy), not G times; transformers 5 already encodes each image once on both paths."""
    model, processor = tiny
    rows, copies, new_tokens = _rows(), 4, 3
    width = int(encode_prompts(processor, rows)["input_ids"].shape[1])
    positions = []
    # the first decoder layer sees every position the text decoder processes (HF's forward and the lean loop alike)
    hook = model.model.language_model.layers[0].register_forward_hook(
        lambda module, args, out: positions.append(args[0].shape[:2].numel()))
    try:
        for prefill_once in (True, False):
            positions.clear()
            torch.manual_seed(0)
            HFGenerateEngine(model, processor, prefill_once=prefill_once).generate(
                rows, num_samples=copies, max_new_tokens=new_tokens, temperature=1.0)
            decode_steps = len(positions) - (2 if prefill_once else 1)
            if prefill_once:
                # 3 prompts x (P - 1) once, then 12 rows x the last prompt token, then 12 rows per new token
                assert positions == [3 * (width - 1), 12] + [12] * decode_steps
            else:
                assert positions == [12 * width] + [12] * decode_steps
            assert decode_steps == new_tokens - 1
    finally:
        hook.remove()


def test_suppressed_ids_merge_the_generation_configs_own_list(tiny):
    """A passed suppress_tokens replaces the model's configured list, so the engine (and the continuation
    path of TreePO / Segment-PO / BRPO / T-PPO) passes the union: vision specials plus the configured ones."""
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    saved = model.generation_config.suppress_tokens
    try:
        model.generation_config.suppress_tokens = None
        assert engine.suppressed_token_ids() == sorted(vision_token_ids(processor))
        model.generation_config.suppress_tokens = [engine.eos_token_id]
        assert engine.suppressed_token_ids() == sorted({engine.eos_token_id, *vision_token_ids(processor)})
    finally:
        model.generation_config.suppress_tokens = saved
