"""build_tiny_vlm writes a real Qwen2.5-VL directory; load_vlm reads it with from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

from mmpo.vlm.factory import (
    QWEN_SPECIAL_TOKENS,
    build_tiny_vlm,
    load_vlm,
    make_reference_model,
    pixel_budget,
    save_vlm,
)

CORPUS = [
    "How many red circles are in the image? <think>There are 3 circles.</think><answer>3</answer>",
    "Is the blue square left or right of the green one? <think>It is left.</think><answer>left</answer>",
    "What is 12 + 7? <think>12 + 7 = 19.</think><answer>19</answer>",
] * 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), seed=0, corpus=CORPUS, vocab_size=400)


def test_saved_directory_is_a_regular_hf_checkpoint(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json", "chat_template.jinja"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    assert config["vision_config"]["patch_size"] == 14
    assert config["vision_config"]["spatial_merge_size"] == 2


def test_load_vlm_returns_real_classes_with_matching_token_ids(tiny_dir):
    model, processor = load_vlm(tiny_dir)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    tokenizer = processor.tokenizer
    assert tokenizer.padding_side == "left"
    # the special tokens are single tokens with ids 0..6 in Qwen's order
    assert [tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS] == list(range(7))
    config = model.config
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert config.text_config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 0
    assert not model.training


def test_chat_template_matches_qwen_layout(tiny_dir):
    _, processor = load_vlm(tiny_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tokenizer_round_trips_text(tiny_dir):
    _, processor = load_vlm(tiny_dir)
    text = "<think>12 + 7 = 19.</think><answer>19</answer>"
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert processor.tokenizer.decode(ids) == text


def test_pixel_budget_override_and_validation(tiny_dir):
    _, processor = load_vlm(tiny_dir, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    assert pixel_budget(processor) == (784, 3136)
    with pytest.raises(ValueError, match="min_pixels"):
        load_vlm(tiny_dir, min_pixels=10_000, max_pixels=1_000)


def test_build_is_deterministic_by_seed(tmp_path):
    a, _ = load_vlm(build_tiny_vlm(tmp_path / "a", seed=3, corpus=CORPUS, vocab_size=300))
    b, _ = load_vlm(build_tiny_vlm(tmp_path / "b", seed=3, corpus=CORPUS, vocab_size=300))
    c, _ = load_vlm(build_tiny_vlm(tmp_path / "c", seed=4, corpus=CORPUS, vocab_size=300))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_vlm(tmp_path, corpus=CORPUS, hidden_size=30, num_heads=4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vlm(tmp_path / "missing")


def test_save_vlm_round_trip(tiny_dir, tmp_path):
    model, processor = load_vlm(tiny_dir)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_vlm(model, processor, tmp_path / "saved")
    reloaded, reloaded_processor = load_vlm(tmp_path / "saved")
    for (name, p), q in zip(model.named_parameters(), reloaded.parameters()):
        assert torch.equal(p, q), name
    assert reloaded_processor.tokenizer.get_vocab() == processor.tokenizer.get_vocab()


def test_reference_model_is_frozen_copy_and_skipped_without_kl(tiny_dir):
    model, _ = load_vlm(tiny_dir)
    assert make_reference_model(model, beta=0.0) is None
    reference = make_reference_model(model, beta=0.01)
    assert reference is not model
    assert all(not p.requires_grad for p in reference.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(next(model.parameters()), next(reference.parameters()))


def test_the_tiny_vlm_tokenizer_corpus_is_pinned():
    """The tiny VLM's tokenizer is trained on this corpus: a task added to it (a text-LM or tool task, which
    run on the text LM) changes every tiny-VLM run and golden artifact, so any change must be deliberate."""
    import hashlib

    from mmpo.vlm.factory import default_corpus

    texts = default_corpus()
    assert len(texts) == 3998
    assert hashlib.sha256("\n".join(texts).encode()).hexdigest() == (
        "38f9733e139a9a6e52781af6a6fc3919b81928b91bd31aabd00aafe98ff0f17f")
