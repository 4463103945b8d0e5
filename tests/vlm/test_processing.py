"""Prompt encoding: qwen-vl-utils images, left padding, token/feature checks, row selection."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.processing import (
    check_image_tokens,
    encode_completions,
    encode_prompts,
    repeat_rows,
    select_rows,
)

CORPUS = [SYSTEM_PROMPT, "How many red circles are in the image? <think>3</think><answer>3</answer>"] * 20


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350)
    return load_vlm(path)[1]


def _rows():
    one_image = make_items("count_shapes", 1, seed=0)[0]
    text_only = make_items("arithmetic", 1, seed=0)[0]
    two_images = {**one_image, "id": "two-images", "images": [one_image["images"][0], Image.new("RGB", (112, 56))]}
    return [one_image, text_only, two_images]


def test_encode_prompts_left_pads_and_counts_images(processor):
    rows = _rows()
    inputs = encode_prompts(processor, rows)
    ids, attention = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == attention.shape and ids.shape[0] == 3
    # left padding: every row ends with a real token, padding only at the start
    assert attention[:, -1].tolist() == [1, 1, 1]
    assert all(torch.equal(a, torch.sort(a)[0]) for a in attention)
    assert inputs["image_counts"].tolist() == [1, 0, 2]
    # 56x56 -> grid (1, 4, 4) -> 16 patches, 4 tokens; 112x56 -> (1, 4, 8) -> 32 patches, 8 tokens
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 8]]
    assert inputs["pixel_values"].shape[0] == 16 + 16 + 32
    image_id = processor.image_token_id
    assert (ids == image_id).sum(-1).tolist() == [4, 0, 4 + 8]
    assert (inputs["mm_token_type_ids"] == 1).sum(-1).tolist() == [4, 0, 12]
    text = processor.tokenizer.decode(ids[1][attention[1].bool()])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_token_feature_mismatch_names_the_row(processor):
    rows = _rows()
    inputs = encode_prompts(processor, rows)
    broken = dict(inputs)
    broken["input_ids"] = inputs["input_ids"].clone()
    position = (broken["input_ids"][2] == processor.image_token_id).nonzero()[0]
    broken["input_ids"][2, position] = 0  # one image token lost, as a truncation would do
    with pytest.raises(ValueError, match="row 'two-images': 11 image tokens but 12 image features"):
        check_image_tokens(broken, [r["id"] for r in rows], image_token_id=processor.image_token_id, merge_size=2)


def test_text_with_literal_image_pad_is_refused(processor):
    row = {**make_items("arithmetic", 1, seed=1)[0], "id": "sneaky", "problem": "What is <|image_pad|> 2?"}
    with pytest.raises(ValueError, match=r"row 'sneaky': the problem text contains <\|image_pad\|>"):
        encode_prompts(processor, [row])
    # the same check on already tokenized inputs
    inputs = encode_prompts(processor, [make_items("arithmetic", 1, seed=1)[0]])
    inputs["input_ids"][0, -1] = processor.image_token_id
    with pytest.raises(ValueError, match="row 'x': 1 image tokens in the prompt but no image features"):
        check_image_tokens(inputs, ["x"], image_token_id=processor.image_token_id, merge_size=2)


def test_long_prompt_is_refused_not_truncated(processor):
    rows = _rows()
    lengths = encode_prompts(processor, rows)["attention_mask"].sum(-1).tolist()
    with pytest.raises(ValueError, match="row 'two-images'.*never truncated"):
        encode_prompts(processor, rows, max_prompt_length=max(lengths) - 1)
    assert encode_prompts(processor, rows, max_prompt_length=max(lengths))["input_ids"].shape[1] == max(lengths)


def test_bad_rows_name_the_item(processor):
    row = make_items("count_shapes", 1, seed=0)[0]
    with pytest.raises(TypeError, match=f"row '{row['id']}': image 0 is str"):
        encode_prompts(processor, [{**row, "images": ["missing.png"]}])
    with pytest.raises(ValueError, match=f"row '{row['id']}': 'problem'"):
        encode_prompts(processor, [{**row, "problem": ""}])


def test_select_and_repeat_rows_keep_pixels_aligned(processor):
    rows = _rows()
    batch = encode_prompts(processor, rows)
    picked = select_rows(batch, [2, 0, 2])
    assert picked["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 4, 4], [1, 4, 4], [1, 4, 8]]
    # row 2's patches are the last 48 of the batch, row 0's the first 16
    expected = torch.cat([batch["pixel_values"][16:], batch["pixel_values"][:16], batch["pixel_values"][16:]])
    assert torch.equal(picked["pixel_values"], expected)
    assert picked["image_counts"].tolist() == [2, 1, 2]
    check_image_tokens(picked, ["a", "b", "c"], image_token_id=processor.image_token_id, merge_size=2)
    repeated = repeat_rows(batch, 2)
    assert repeated["input_ids"].shape[0] == 6
    assert torch.equal(repeated["input_ids"][0], repeated["input_ids"][1])
    assert repeated["image_counts"].tolist() == [1, 1, 0, 0, 2, 2]
    assert repeated["pixel_values"].shape[0] == 2 * 64
    text_only = select_rows(batch, [1])
    assert "pixel_values" not in text_only and text_only["input_ids"].shape == (1, batch["input_ids"].shape[1])


def test_encode_completions_appends_eos_and_right_pads(processor):
    tokenizer = processor.tokenizer
    ids, mask = encode_completions(processor, ["<answer>3</answer>", "3"])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    lengths = mask.sum(-1).tolist()
    assert lengths[0] > lengths[1]
    for row, length in zip(ids, lengths):
        assert row[length - 1].item() == eos
        assert (row[length:] == tokenizer.pad_token_id).all()
    assert tokenizer.decode(ids[0, : lengths[0] - 1]) == "<answer>3</answer>"
    truncated_ids, truncated_mask = encode_completions(processor, ["<answer>3</answer>"], max_length=2)
    assert truncated_ids.shape == (1, 2) and truncated_mask.sum() == 2


def test_large_images_are_resized_into_the_pixel_budget(processor):
    """A 300x300 image is resized (qwen-vl-utils + processor) into max_pixels = 12544 (112 x 112)."""
    row = {**make_items("count_shapes", 1, seed=0)[0], "id": "big", "images": [Image.new("RGB", (300, 300))]}
    inputs = encode_prompts(processor, [row])
    # smart_resize: 300 -> 308 (multiple of 28); 308^2 = 94864 > 12544, so beta = sqrt(94864 / 12544)
    # = 2.75 and each side becomes floor(300 / 2.75 / 28) * 28 = 3 * 28 = 84: 84 / 14 = 6 patches a side
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 6]]
    assert (inputs["input_ids"] == processor.image_token_id).sum() == 6 * 6 // 4
