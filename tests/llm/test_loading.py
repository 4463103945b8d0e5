"""Text-only LMs through the VLM pipeline (issue 38): the model-kind switch, tokenizer-only prompts, the
engine's one-prefill rollout and lean decoding loop, the chunked log-probs, and one GRPO step on a Qwen3
checkpoint written by hand with ``save_pretrained``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from tiny_vlm_support import build_small_text_lm, build_small_vlm
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import (
    QWEN_TEXT_CHAT_TEMPLATE,
    TextProcessor,
    is_text_processor,
    load_vlm,
    model_kind,
    turn_end_token_id,
)
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.processing import encode_completions, encode_prompts
from mmpo.vlm.rollout import HFGenerateEngine, lean_decode_blocker

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "llm"


@pytest.fixture(scope="module")
def text_path(tmp_path_factory) -> str:
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def text(text_path):
    return load_vlm(text_path)


def _rows():
    """Three text prompts of different lengths (two are left-padded)."""
    return make_items("long_arithmetic", 1, seed=0) + make_items("word_problem", 1, seed=0) + make_items(
        "countdown", 1, seed=0)


# ------------------------------------------------------------------------------------------- the kind switch
def test_model_kind_reads_the_config():
    from tiny_vlm_support import tiny_qwen3_vl_config
    from transformers import Qwen2_5_VLConfig

    assert model_kind(Qwen2_5_VLConfig()) == "vlm"
    assert model_kind(tiny_qwen3_vl_config()) == "vlm"
    for config in (Qwen3Config(), Qwen2Config(), LlamaConfig()):
        assert model_kind(config) == "text"
    # a saved config.json (a dict), as the checkpoint states it
    assert model_kind({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}) == "text"
    assert model_kind({"model_type": "qwen2_5_vl", "vision_config": {"depth": 1}}) == "vlm"
    with pytest.raises(ValueError, match="neither"):
        model_kind({"model_type": "bert", "architectures": ["BertForMaskedLM"]})


def test_load_vlm_takes_the_vlm_path_for_a_vlm_and_the_text_path_for_a_text_lm(text_path, tmp_path):
    vlm, vlm_processor = load_vlm(build_small_vlm(tmp_path / "vlm"))
    assert isinstance(vlm, Qwen2_5_VLForConditionalGeneration) and not is_text_processor(vlm_processor)
    model, processor = load_vlm(text_path)
    assert isinstance(model, Qwen3ForCausalLM) and isinstance(processor, TextProcessor)
    assert is_text_processor(processor) and processor.tokenizer.padding_side == "left"
    assert processor.tokenizer.chat_template == QWEN_TEXT_CHAT_TEMPLATE
    assert not model.training
    # the tiny text tokenizer: ChatML's three special tokens at ids 0, 1, 2
    tokenizer = processor.tokenizer
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert turn_end_token_id(tokenizer) == 2 == model.generation_config.eos_token_id
    # a text LM has no image processor
    with pytest.raises(ValueError, match="text-only"):
        load_vlm(text_path, max_pixels=1000)


# ----------------------------------------------------------------------------------------------- processing
def test_prompt_ids_are_the_tokenizers_chat_template_output(text):
    model, processor = text
    tokenizer = processor.tokenizer
    rows = _rows()
    rows[1] = {**rows[1], "system_prompt": "Answer briefly."}  # a row's own system turn wins
    rows[2] = {**rows[2], "assistant_prefix": "<think>"}
    inputs = encode_prompts(processor, rows)
    assert set(inputs) == {"input_ids", "attention_mask", "image_counts"}
    assert inputs["image_counts"].tolist() == [0, 0, 0]
    assert (inputs["attention_mask"] == 0).any()  # left padding present
    for index, row in enumerate(rows):
        messages = [{"role": "system", "content": row.get("system_prompt", SYSTEM_PROMPT)},
                    {"role": "user", "content": row["problem"]}]
        expected = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
        if row.get("assistant_prefix"):
            expected += tokenizer(row["assistant_prefix"], add_special_tokens=False)["input_ids"]
        mask = inputs["attention_mask"][index].bool()
        assert inputs["input_ids"][index][mask].tolist() == expected
        assert mask.tolist() == sorted(mask.tolist())  # padding on the left only
    # the text the template renders: ChatML with the system prompt
    text = tokenizer.decode(inputs["input_ids"][0][inputs["attention_mask"][0].bool()])
    assert text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{rows[0]['problem']}"
                    "<|im_end|>\n<|im_start|>assistant\n")
    # no system prompt: the template's own default system turn
    bare = encode_prompts(processor, rows[:1], system_prompt=None)
    assert tokenizer.decode(bare["input_ids"][0]).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_text_prompts_refuse_images_and_long_prompts(text):
    _, processor = text
    with pytest.raises(ValueError, match="count_shapes-train-s0-0.*text-only LM"):
        encode_prompts(processor, make_items("count_shapes", 1, seed=0))
    with pytest.raises(ValueError, match="never truncated"):
        encode_prompts(processor, _rows(), max_prompt_length=5)


def test_completions_end_with_the_turn_end_token(text):
    _, processor = text
    ids, mask = encode_completions(processor, ["<answer>3</answer>", "7"])
    tokenizer = processor.tokenizer
    assert ids[1, : int(mask[1].sum())].tolist() == tokenizer("7", add_special_tokens=False)["input_ids"] + [2]
    assert ids[0, int(mask[0].sum()) - 1] == 2


# ------------------------------------------------------------------------------------------ rollout engine
def _save_text_lm(directory: Path, architecture: str, tokenizer) -> str:
    """A tiny randomly initialised ``architecture`` saved with ``save_pretrained`` beside ``tokenizer``."""
    ids = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False)
    config, cls = {"qwen3": (Qwen3Config(head_dim=8, **ids), Qwen3ForCausalLM),
                   "qwen2": (Qwen2Config(**ids), Qwen2ForCausalLM),
                   "llama": (LlamaConfig(**ids), LlamaForCausalLM)}[architecture]
    torch.manual_seed(1)
    cls(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_lean_loop_samples_hf_generates_tokens_and_log_probs_match(text, tmp_path, architecture):
    """G = 3 on left-padded prompts: the lean loop after the one prefill samples HF generate's tokens from the
    same RNG state, and the training forward's chunked log-probs equal the sampler's (same positions)."""
    path = _save_text_lm(tmp_path / architecture, architecture, text[1].tokenizer)
    model, processor = load_vlm(path)
    assert model_kind(model.config) == "text" and type(model).__name__.lower().startswith(architecture)
    out = []
    for lean in (True, False):
        engine = HFGenerateEngine(model, processor, lean_decode=lean)
        torch.manual_seed(0)
        rollout = engine.generate(_rows(), num_samples=3, max_new_tokens=8, temperature=0.8, top_p=0.95,
                                  return_log_probs=True)
        out.append((rollout, engine.last_decode, torch.rand(3)))
    (lean, lean_path, lean_next), (hf, hf_path, hf_next) = out
    assert (lean_path, hf_path) == ("lean", "lean_decode=False")
    assert torch.equal(lean.completion_ids, hf.completion_ids) and lean.texts == hf.texts
    assert torch.equal(lean_next, hf_next)
    torch.testing.assert_close(lean.extras["engine_log_probs"], hf.extras["engine_log_probs"], atol=1e-5, rtol=0)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, lean.prompt_inputs, lean.completion_ids, lean.completion_mask,
                                            temperature=0.8)
    mask = lean.completion_mask.bool()
    # top-p moves the sampler's distribution off the plain tempered softmax where it cuts the tail:
    # compare the tokens whose sampled probability the cut did not renormalise away (all, at top_p 1)
    engine = HFGenerateEngine(model, processor)
    torch.manual_seed(0)
    plain = engine.generate(_rows(), num_samples=3, max_new_tokens=8, temperature=0.8, return_log_probs=True)
    with torch.no_grad():
        plain_lp, _ = completion_log_probs(model, plain.prompt_inputs, plain.completion_ids, plain.completion_mask,
                                           temperature=0.8)
    plain_mask = plain.completion_mask.bool()
    torch.testing.assert_close(plain_lp[plain_mask], plain.extras["engine_log_probs"][plain_mask], atol=1e-4, rtol=0)
    assert mask.any()



@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("padded,chunk", [(True, 1), (False, 1), (True, 3)], ids=["mask", "no-mask", "chunk"])
def test_direct_decode_layer_step_equals_the_hf_layer_to_the_bit(text, tmp_path, architecture, padded, chunk):
    """The lean loop's direct layer step (HF's ops without the module wrappers) against the HF layer's own call
    on the same decode step: the same hidden states and cache entries, bit for bit, with a padding mask (GQA
    packed) and without one (sdpa's own GQA); a training-mode layer or one with a hook is left to HF's call. With
    ``chunk`` 3, three new tokens per row under a 4-D mask (the cache and causal within the chunk), as the multi-turn
    loop runs an environment's answer onto its cache (mask always given there)."""
    from mmpo.vlm.rollout import _GrowingKVCache, decode_layer_step, direct_decode_layer
    from transformers import DynamicCache

    model, _ = load_vlm(_save_text_lm(tmp_path / architecture, architecture, text[1].tokenizer))
    model.eval()
    backbone, rows, width = model.model, 4, 5
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 40, (rows, width), generator=generator)
    attention = torch.ones(rows, width, dtype=torch.long)
    if padded:
        attention[:2, :2] = 0
    results = []
    for direct in (False, True):
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            backbone(input_ids=prompt, attention_mask=attention, cache=cache, use_cache=True)
            grown = _GrowingKVCache(cache, chunk + 1)
            new = torch.randint(3, 40, (rows, chunk), generator=torch.Generator().manual_seed(4))
            hidden = backbone.embed_tokens(new)
            rope = backbone.rotary_emb(hidden, attention.sum(-1, keepdim=True) + torch.arange(chunk))
            mask = None
            if padded:
                mask = torch.ones(rows, 1, chunk, width + chunk, dtype=torch.bool)
                mask[:, 0, :, :width] = attention.bool()[:, None, :]
                mask[:, 0, :, width:] = torch.ones(chunk, chunk, dtype=torch.bool).tril()
            for layer in backbone.layers:
                assert direct_decode_layer(layer)
                hidden = (decode_layer_step(layer, hidden, mask, rope, grown) if direct else
                          layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None, cache=grown,
                                use_cache=True))
        results.append((hidden, [k[:, :, : width + chunk].clone() for k in grown.keys + grown.values]))
    (hf, hf_cache), (ours, our_cache) = results
    assert torch.equal(hf, ours)
    assert all(torch.equal(a, b) for a, b in zip(hf_cache, our_cache))
    layer = backbone.layers[0]
    layer.train()
    assert not direct_decode_layer(layer)
    layer.eval()
    handle = layer.mlp.register_forward_hook(lambda *args: None)
    assert not direct_decode_layer(layer)
    handle.remove()
    assert direct_decode_layer(layer)


def test_lean_loop_takes_the_direct_layer_step_and_samples_hf_generates_tokens(text, monkeypatch):
    """The tiny Qwen3's rollout goes through the direct layer step (every layer, every step) and still samples
    HF generate's tokens: one prompt (no padding mask) and three left-padded ones."""
    from mmpo.vlm import rollout as rollout_module

    model, processor = text
    calls = []
    step = rollout_module.decode_layer_step
    monkeypatch.setattr(rollout_module, "decode_layer_step", lambda *args: calls.append(1) or step(*args))
    for rows in (_rows()[:1], _rows()):
        out = []
        for lean in (True, False):
            engine = HFGenerateEngine(model, processor, lean_decode=lean)
            torch.manual_seed(0)
            out.append(engine.generate(rows, num_samples=3, max_new_tokens=6).completion_ids)
        assert torch.equal(out[0], out[1])
    assert len(calls) == 2 * 6 * len(model.model.layers)  # two rollouts (no EOS here before 6 tokens) x 6 steps

def test_lean_loop_blockers_for_text_lms(text):
    model, processor = text
    inputs = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
    assert lean_decode_blocker(model, inputs, do_sample=True, max_new_tokens=4).startswith("no prefilled cache")
    assert lean_decode_blocker(model, {**inputs, "cache": None}, do_sample=False, max_new_tokens=4) == "greedy"


# ---------------------------------------------------------------------- one GRPO step on a hand-saved Qwen3
def test_one_grpo_step_on_a_qwen3_saved_with_save_pretrained(text, tmp_path):
    path = _save_text_lm(tmp_path / "qwen3", "qwen3", text[1].tokenizer)
    assert json.loads((Path(path) / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    out = tmp_path / "grpo_hf"
    # a random model answers nothing right (accuracy 0 everywhere, no advantage): a user reward that
    # varies with the completion's length gives every group reward variance
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text("def chars(prompts, completions, **columns):\n"
                           "    return [float(len(c)) for c in completions]\n")
    assert main([
        "fit", "-c", str(CONFIGS / "grpo_tiny.yaml"),
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}", "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--model.init_args.model_path={path}", f"--model.init_args.output_dir={out}",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
        f"--model.init_args.rewards.weights={{accuracy: 0.5, '{reward_file}:chars': 0.5}}",
        "--data.init_args.tasks=[long_arithmetic,countdown]", "--data.init_args.train_size=4",
        "--data.init_args.val_size=2", "--data.init_args.batch_size=2",
    ]) == 0
    before, _ = load_vlm(path)
    after, processor = load_vlm(out)
    assert isinstance(after, Qwen3ForCausalLM) and isinstance(processor, TextProcessor)
    assert any(not torch.equal(a, b) for a, b in zip(after.parameters(), before.parameters()))
    (metrics,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert any(r.get("losses/policy") for r in rows) and any(r.get("rewards/accuracy/mean") for r in rows)
