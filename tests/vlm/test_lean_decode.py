"""The engine's lean decoding loop (HFGenerateEngine._lean_decode) against HF generate on the tiny Qwen2.5-VL:
the same RNG state samples the same tokens, and every case the loop does not cover goes to HF generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm import rollout as rollout_module
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.rollout import HFGenerateEngine, lean_decode_blocker
from tiny_vlm_support import tiny_qwen3_vl_config

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_vlm(tiny_path)


def _rows():
    """Two prompts with an image and a text-only one: three widths, so two are left-padded."""
    return make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)


@contextlib.contextmanager
def _eos_bias(model, eos: int, bias: float):
    """An output layer that adds ``bias`` to the EOS logit (rows end at random points)."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = bias
    model.set_output_embeddings(biased)
    try:
        yield
    finally:
        model.set_output_embeddings(head)


def _both(model, processor, rows, *, seed=0, **kwargs):
    """(lean rollout, HF-generate rollout, RNG draws after each), each from ``seed``."""
    out = []
    for lean in (True, False):
        engine = HFGenerateEngine(model, processor, lean_decode=lean)
        torch.manual_seed(seed)
        rollout = engine.generate(rows, **kwargs)
        out.append((rollout, engine.last_decode, torch.rand(4)))
    (lean, lean_path, lean_after), (hf, hf_path, hf_after) = out
    assert (lean_path, hf_path) == ("lean", "lean_decode=False")
    return lean, hf, lean_after, hf_after


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0, top_p=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_p=0.5, return_log_probs=True),
], ids=["t1", "t0.7-p0.9", "t1.3-p0.5-logprobs"])
def test_lean_loop_samples_hf_generates_tokens(tiny, sampling):
    """Left-padded prompts of three widths (two with an image, one text-only), G 4: the same tokens, the same
    engine log-probs and the same RNG state afterwards (the next draw agrees too)."""
    model, processor = tiny
    lean, hf, lean_after, hf_after = _both(model, processor, _rows(), num_samples=4, max_new_tokens=10, **sampling)
    assert (lean.prompt_inputs["attention_mask"] == 0).any()  # left padding present
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    assert torch.equal(lean.completion_mask, hf.completion_mask)
    assert lean.texts == hf.texts
    assert torch.equal(lean_after, hf_after)
    assert len({tuple(x) for x in lean.completion_ids[:4].tolist()}) > 1  # the G copies sample apart
    assert not lean.completion_ids.is_inference()  # ordinary tensors (the loop runs in inference mode)
    if sampling.get("return_log_probs"):
        assert not lean.extras["engine_log_probs"].is_inference()
        mask = lean.completion_mask.bool()
        torch.testing.assert_close(lean.extras["engine_log_probs"], hf.extras["engine_log_probs"], atol=1e-5, rtol=0)
        assert torch.isfinite(lean.extras["engine_log_probs"][mask]).all()


def test_lean_loop_samples_hf_generates_tokens_in_bfloat16(tiny_path):
    """bf16 weights (the GPU configs' dtype): the same tokens and log-probs (logits cast to float32 as HF)."""
    model, processor = load_vlm(tiny_path, dtype=torch.bfloat16)
    lean, hf, lean_after, hf_after = _both(model, processor, _rows(), num_samples=4, max_new_tokens=10,
                                           temperature=0.8, top_p=0.9, return_log_probs=True)
    assert torch.equal(lean.completion_ids, hf.completion_ids) and torch.equal(lean_after, hf_after)
    torch.testing.assert_close(lean.extras["engine_log_probs"], hf.extras["engine_log_probs"], atol=1e-5, rtol=0)


def test_lean_loop_matches_hf_when_rows_end_at_different_steps(tiny):
    """EOS logit + 3 (about 1 in 6 per step here): rows end mid-way at different steps (padded after their EOS), and
    the loop stops when all have ended or at max_new_tokens, exactly where HF does."""
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    with _eos_bias(model, engine.eos_token_id, 3.0):
        lean, hf, lean_after, hf_after = _both(model, processor, _rows(), num_samples=4, max_new_tokens=16,
                                               temperature=0.9, return_log_probs=True)
    lengths = lean.completion_mask.sum(-1)
    assert lengths.min() < 16 and len(set(lengths.tolist())) > 2  # ended mid-way, at different steps
    assert (lean.completion_ids[lean.completion_mask == 0] == engine.pad_token_id).all()
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    assert lean.completion_ids.shape == hf.completion_ids.shape
    assert torch.equal(lean_after, hf_after)
    torch.testing.assert_close(lean.extras["engine_log_probs"], hf.extras["engine_log_probs"], atol=1e-5, rtol=0)


def test_lean_loop_applies_min_new_tokens(tiny):
    """The generation config's min_new_tokens keeps EOS out for that many tokens (on both paths): with EOS
    biased to ~always win, every row ends exactly at token min_new_tokens + 1, and decoding stops there."""
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    saved = model.generation_config.min_new_tokens
    model.generation_config.min_new_tokens = 5
    try:
        with _eos_bias(model, engine.eos_token_id, 40.0):
            lean, hf, lean_after, hf_after = _both(model, processor, _rows(), num_samples=3, max_new_tokens=12)
    finally:
        model.generation_config.min_new_tokens = saved
    assert lean.completion_mask.sum(-1).tolist() == [6] * 9
    assert lean.completion_ids.shape == (9, 6)  # all rows ended: no step after the sixth
    assert (lean.completion_ids[:, 5] == engine.eos_token_id).all()
    assert torch.equal(lean.completion_ids, hf.completion_ids) and torch.equal(lean_after, hf_after)


def test_lean_loop_text_only_batch(tiny):
    """A text-only batch (HF generate's one-token prefill sets the RoPE offsets to 0): the lean loop decodes it."""
    model, processor = tiny
    rows = make_items("arithmetic", 2, seed=1)
    lean, hf, lean_after, hf_after = _both(model, processor, rows, num_samples=3, max_new_tokens=8, temperature=0.8)
    assert torch.equal(lean.completion_ids, hf.completion_ids) and torch.equal(lean_after, hf_after)


class _Recording(LogitsProcessor):
    """Keeps only the ``allowed`` tokens and records the input-id widths it was called with."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed, self.widths = allowed, []

    def __call__(self, input_ids, scores):
        self.widths.append(input_ids.shape[1])
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.allowed] = 0.0
        return scores + keep


def test_user_logits_processors_are_applied(tiny):
    """A user processor sees the running sequence (prompt + tokens so far, as HF passes it) and its output is
    what is sampled from: only its allowed tokens appear; HF generate samples the same."""
    model, processor = tiny
    tokenizer = processor.tokenizer
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("3", "4", "5")]
    runs = []
    for lean in (True, False):
        recording = _Recording(allowed)
        engine = HFGenerateEngine(model, processor, lean_decode=lean)
        torch.manual_seed(4)
        rollout = engine.generate(_rows(), num_samples=2, max_new_tokens=6, temperature=0.8, top_p=0.95,
                                  logits_processors=[recording], return_log_probs=True)
        runs.append((rollout, recording.widths, engine.last_decode))
    (lean, lean_widths, path), (hf, hf_widths, _) = runs
    assert path == "lean"
    assert set(lean.completion_ids.unique().tolist()) <= set(allowed)
    width = lean.prompt_inputs["input_ids"].shape[1]
    assert lean_widths == hf_widths == [width + k for k in range(6)]
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    torch.testing.assert_close(lean.extras["engine_log_probs"], hf.extras["engine_log_probs"], atol=1e-5, rtol=0)


def test_vision_tokens_are_never_sampled_by_the_lean_loop(tiny):
    """An output layer that makes the vision tokens take ~all the probability: the loop's suppression mask
    still never draws one (the HF path is tested in test_rollout.py)."""
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    forbidden = engine.forbidden_ids
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[forbidden] = 30.0
    model.set_output_embeddings(biased)
    try:
        torch.manual_seed(0)
        rollout = engine.generate(_rows(), num_samples=4, max_new_tokens=8, return_log_probs=True)
    finally:
        model.set_output_embeddings(head)
    assert engine.last_decode == "lean"
    assert not torch.isin(rollout.completion_ids, torch.tensor(forbidden)).any()
    assert rollout.extras["vision_cut"].tolist() == [False] * 12
    assert torch.isfinite(rollout.extras["engine_log_probs"][rollout.completion_mask.bool()]).all()


# ----------------------------------------------------------------------------- where HF generate decodes


@pytest.mark.parametrize("case, expected", [
    (dict(num_samples=3, do_sample=False), "greedy"),
    (dict(num_samples=1), "no prefilled cache"),
    (dict(num_samples=3, prefill_once=False), "no prefilled cache"),
    (dict(num_samples=3, lean_decode=False), "lean_decode=False"),
    (dict(num_samples=3, generation_config={"repetition_penalty": 1.2}), "generation_config.repetition_penalty=1.2"),
    (dict(num_samples=3, generation_config={"no_repeat_ngram_size": 2}), "generation_config.no_repeat_ngram_size=2"),
    (dict(num_samples=3, generation_config={"min_length": 10}), "generation_config.min_length=10"),
])
def test_hf_generate_decodes_what_the_lean_loop_does_not_cover(tiny, monkeypatch, case, expected):
    model, processor = tiny
    case = dict(case)
    for key, value in case.pop("generation_config", {}).items():
        monkeypatch.setattr(model.generation_config, key, value)
    engine = HFGenerateEngine(model, processor, prefill_once=case.pop("prefill_once", True),
                              lean_decode=case.pop("lean_decode", True))
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    torch.manual_seed(0)
    rollout = engine.generate(_rows(), max_new_tokens=4, **case)
    assert engine.last_decode.startswith(expected)
    assert calls  # HF generate decoded
    assert rollout.completion_ids.shape[0] == 3 * case["num_samples"]


def test_lean_decode_blocker_names_other_models_attention_and_caches(tiny, tiny_path):
    """Qwen3-VL (and every class but Qwen2.5-VL's), eager attention, a static cache, a compile config and
    max_new_tokens 0 go to HF; the plain Qwen2.5-VL case does not."""
    from transformers import CompileConfig, Qwen3VLForConditionalGeneration, StaticCache

    model, _ = tiny
    dynamic = {"cache": DynamicCache(config=model.config)}
    model.model.rope_deltas = torch.zeros(1, 1, dtype=torch.long)
    assert lean_decode_blocker(model, dynamic, do_sample=True, max_new_tokens=4) is None
    assert lean_decode_blocker(model, dynamic, do_sample=True, max_new_tokens=0) == "max_new_tokens 0"
    static = {"cache": StaticCache(config=model.config, max_cache_len=8)}
    assert lean_decode_blocker(model, static, do_sample=True, max_new_tokens=4) == "cache StaticCache"
    model.generation_config.compile_config = CompileConfig()
    try:
        assert lean_decode_blocker(model, dynamic, do_sample=True, max_new_tokens=4).startswith(
            "generation_config.compile_config=")
    finally:
        model.generation_config.compile_config = None
    model.model.rope_deltas = None
    assert lean_decode_blocker(model, dynamic, do_sample=True, max_new_tokens=4) == "no RoPE offsets"
    eager, _ = load_vlm(tiny_path, attn_implementation="eager")
    eager.model.rope_deltas = torch.zeros(1, 1, dtype=torch.long)
    assert lean_decode_blocker(eager, dynamic, do_sample=True, max_new_tokens=4) == "attention eager"
    qwen3 = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config())
    assert lean_decode_blocker(qwen3, dynamic, do_sample=True, max_new_tokens=4) == (
        "model class Qwen3VLForConditionalGeneration")


def test_rollouts_build_no_autograd_graph(tiny):
    """In ``training_step`` grad is enabled; neither the prefill nor either decoder may record a graph (the
    prefill used to, keeping its activations alive for nothing): every decoder-layer output is grad-free."""
    model, processor = tiny
    seen = []
    hook = model.model.language_model.layers[0].register_forward_hook(
        lambda module, args, out: seen.append(out.requires_grad))
    try:
        with torch.enable_grad():
            for lean in (True, False):
                torch.manual_seed(0)
                HFGenerateEngine(model, processor, lean_decode=lean).generate(_rows(), num_samples=2, max_new_tokens=3)
    finally:
        hook.remove()
    assert len(seen) > 4 and not any(seen)
