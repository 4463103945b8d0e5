"""No-grad completion log-probs encode each distinct image once (old / reference log-probs of a
rollout whose G completions repeat their prompt's images): same values as encoding every copy."""

from __future__ import annotations

import pytest
import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


def _vision_calls(model):
    calls: list[int] = []
    return calls, model.model.visual.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))


def _both(model, prompts, completion_ids, completion_mask):
    """(no-grad log-probs, log-probs with grad, patches the vision tower saw in each)."""
    calls, hook = _vision_calls(model)
    try:
        with torch.no_grad():
            shared, _ = completion_log_probs(model, prompts, completion_ids, completion_mask)
        plain, _ = completion_log_probs(model, prompts, completion_ids, completion_mask)
    finally:
        hook.remove()
    return shared, plain.detach(), calls


def test_qwen2_5_vl_rollout_images_are_encoded_once(tmp_path):
    model, processor = load_vlm(build_tiny_vlm(tmp_path / "tiny", corpus=CORPUS, vocab_size=350))
    rows = make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)  # 2 images, 1 text row
    torch.manual_seed(0)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=3, max_new_tokens=5)
    shared, plain, calls = _both(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    patches = int(rollout.prompt_inputs["pixel_values"].shape[0])  # 6 image copies
    assert calls == [patches // 3, patches]  # 2 distinct images without grad; all 6 copies with grad
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_qwen3_vl_deepstack_features_follow_their_image():
    """Qwen3-VL also injects per-image deepstack features into early decoder layers: they are shared per
    image as well. A tiny random Qwen3-VL, rows 0-2 sharing image A and row 3 showing image B."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
    model = Qwen3VLForConditionalGeneration(config).eval()
    image_a, image_b = torch.randn(16, 96), torch.randn(16, 96)  # grid 1x4x4: 16 patches -> 4 tokens each
    ids = torch.tensor([[5, 62, 60, 60, 60, 60, 63, 7, 8]] * 4)
    prompts = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == 60).long(),
                   pixel_values=torch.cat([image_a, image_a, image_a, image_b]),
                   image_grid_thw=torch.tensor([[1, 4, 4]] * 4))
    completion = torch.randint(0, 50, (1, 3)).repeat(4, 1)  # the same completion on every row
    shared, plain, calls = _both(model, prompts, completion, torch.ones_like(completion))
    assert calls == [32, 64]
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], shared[0], atol=0, rtol=0)  # same image, same text: same values
    assert (shared[3] - shared[0]).abs().max() > 1e-3  # image B's row differs: its features were not swapped
