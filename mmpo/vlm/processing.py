"""Rows -> model inputs for Qwen-VL models and text-only LMs: chat messages, images, token checks.

A text LM's processor (:class:`mmpo.vlm.factory.TextProcessor`) takes the same calls: its prompts are the
tokenizer's chat template over string messages (the same system prompt and row keys), no image keys.

Images go through qwen-vl-utils' ``process_vision_info`` with the processor's own
pixel budget, so the resize qwen-vl-utils does and the one the image processor does
agree. Prompts are left-padded (generation appends on the right) and are never
truncated: cutting through an image span is the most common cause of "Image features
and image tokens do not match" (EasyR1#175, #266, #641); we refuse such a row instead.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch
from PIL import Image
from transformers import BatchFeature

from mmpo.vlm.factory import is_text_processor, pixel_budget, turn_end_token_id

Row = Mapping[str, Any]

# Qwen-VL vision markup; it must never appear in raw text (it would desync tokens and features).
VISION_MARKUP = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")

# Keys of a processor output that hold one entry per image rather than one per row.
_PER_IMAGE_KEYS = ("image_grid_thw",)


def default_system_prompt() -> str:
    """``mmpo.data.SYSTEM_PROMPT`` (imported lazily so this module loads without the data package)."""
    from mmpo.data import SYSTEM_PROMPT

    return SYSTEM_PROMPT


def build_messages(
    row: Row, *, system_prompt: str | None, min_pixels: int | None = None, max_pixels: int | None = None
) -> list[dict]:
    """One row -> Qwen chat messages: optional system turn, then a user turn (images first, then text).

    A row's own ``system_prompt`` (set by a data config) wins over ``system_prompt``.
    """
    row_id = row.get("id", "<no id>")
    system_prompt = row.get("system_prompt", system_prompt)
    images = row.get("images") or []
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"row {row_id!r}: 'problem' must be a non-empty string, got {problem!r}")
    for token in VISION_MARKUP:
        if token in problem:
            raise ValueError(
                f"row {row_id!r}: the problem text contains {token}; images are passed in 'images', "
                "the chat template inserts their placeholders"
            )
    content: list[dict] = []
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"row {row_id!r}: image {index} is {type(image).__name__}, expected PIL.Image.Image")
        item: dict[str, Any] = {"type": "image", "image": image}
        if min_pixels is not None:
            item["min_pixels"] = min_pixels
        if max_pixels is not None:
            item["max_pixels"] = max_pixels
        content.append(item)
    content.append({"type": "text", "text": problem})
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return messages


def build_text_messages(row: Row, *, system_prompt: str | None) -> list[dict]:
    """One row -> chat messages for a text-only LM: optional system turn, then the user's ``problem`` as a
    string (the form every text chat template takes). A row with images is refused, naming the row."""
    row_id = row.get("id", "<no id>")
    system_prompt = row.get("system_prompt", system_prompt)
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"row {row_id!r}: 'problem' must be a non-empty string, got {problem!r}")
    if row.get("images"):
        raise ValueError(f"row {row_id!r} has {len(row['images'])} image(s) but the model is a text-only LM: "
                         "use text tasks (mmpo.data.synthetic.TEXT_TASKS) or a dataset without images")
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": problem})
    return messages


def _encode_text_prompts(processor: Any, rows: Sequence[Row], *, system_prompt: str | None,
                         max_prompt_length: int | None) -> BatchFeature:
    """:func:`encode_prompts` for a text-only LM: chat template text, tokenized without added special tokens."""
    tokenizer = processor.tokenizer
    conversations = [build_text_messages(row, system_prompt=system_prompt) for row in rows]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    texts = [text + (row.get("assistant_prefix") or "") for text, row in zip(texts, rows)]
    tokenizer.padding_side = "left"
    inputs = processor(text=texts, padding=True, return_tensors="pt")
    out = BatchFeature({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                        "image_counts": torch.zeros(len(rows), dtype=torch.long)})
    if max_prompt_length is not None:
        for index, (row, length) in enumerate(zip(rows, out["attention_mask"].sum(-1).tolist())):
            if length > max_prompt_length:
                raise ValueError(f"row {str(row.get('id', index))!r}: prompt has {length} tokens > max_prompt_length "
                                 f"{max_prompt_length}; prompts are never truncated: raise max_prompt_length")
    return out


def _merge_size(processor: Any) -> int:
    return int(getattr(processor.image_processor, "merge_size", 2))


def _patch_size(processor: Any) -> int:
    return int(getattr(processor.image_processor, "patch_size", 14))


def encode_prompts(
    processor: Any,
    rows: Sequence[Row],
    *,
    system_prompt: str | None = "default",
    max_prompt_length: int | None = None,
) -> BatchFeature:
    """Tokenize rows' prompts (chat template + images) into one left-padded batch.

    Args:
        processor: a Qwen-VL processor (``load_vlm`` sets left padding).
        rows: dataset rows (``id``, ``images``, ``problem``; optional ``assistant_prefix``, text the
            assistant turn starts with, which the policy then continues).
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT``; None or "" = no system turn.
        max_prompt_length: refuse (ValueError naming the row) any prompt longer than this;
            prompts are never truncated.

    Returns:
        BatchFeature with ``input_ids`` (B, P), ``attention_mask`` (B, P), ``mm_token_type_ids``
        (B, P; not for a text-only LM) and, when any row has images, ``pixel_values`` (num_patches, C*T*p*p) and
        ``image_grid_thw`` (num_images, 3). ``image_counts`` (B,) is added: images per row.
    """
    if len(rows) == 0:
        raise ValueError("encode_prompts: no rows")
    if system_prompt == "default":
        system_prompt = default_system_prompt()
    if is_text_processor(processor):
        return _encode_text_prompts(processor, rows, system_prompt=system_prompt, max_prompt_length=max_prompt_length)
    from qwen_vl_utils import process_vision_info

    min_pixels, max_pixels = pixel_budget(processor)
    conversations = [
        build_messages(row, system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels)
        for row in rows
    ]
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    # an optional prefill of the assistant turn (HBPO's budget declaration): the policy continues it
    texts = [text + (row.get("assistant_prefix") or "") for text, row in zip(texts, rows)]
    images, _ = process_vision_info(conversations, image_patch_size=_patch_size(processor))[:2]
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
    inputs["image_counts"] = torch.tensor([len(row.get("images") or []) for row in rows], dtype=torch.long)
    if "mm_token_type_ids" not in inputs:
        inputs["mm_token_type_ids"] = image_token_types(inputs["input_ids"], processor)
    row_ids = [str(row.get("id", index)) for index, row in enumerate(rows)]
    check_image_tokens(inputs, row_ids, image_token_id=image_token_id(processor), merge_size=_merge_size(processor))
    if max_prompt_length is not None:
        lengths = inputs["attention_mask"].sum(-1)
        for row_id, length in zip(row_ids, lengths.tolist()):
            if length > max_prompt_length:
                raise ValueError(
                    f"row {row_id!r}: prompt has {length} tokens > max_prompt_length {max_prompt_length}; "
                    "prompts are never truncated (that would cut image tokens): raise max_prompt_length "
                    "or lower max_pixels"
                )
    return inputs


def image_token_id(processor: Any) -> int:
    """Id of the image placeholder token (``<|image_pad|>``)."""
    return int(processor.image_token_id)


# Added tokens whose text names vision markup: Qwen2-VL / 2.5-VL / 3-VL spell them <|vision_start|>,
# <|vision_end|>, <|vision_pad|>, <|image_pad|>, <|video_pad|>; the pattern finds them in any such vocabulary.
_VISION_TOKEN_PATTERN = re.compile(r"^<\|(vision|image|video)_[a-z]+\|>$")


def vision_token_ids(processor: Any) -> list[int]:
    """Ids the policy must never emit as text, derived from the processor and its tokenizer.

    The union of (a) the processor's / tokenizer's declared ids (``image_token_id``,
    ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id`` where present, as
    Qwen3-VL's processor declares all four) and (b) every added special token whose text is vision
    markup (``<|vision_*|>``, ``<|image_*|>``, ``<|video_*|>``), so no vocabulary needs a list here.
    Sorted, without duplicates.
    """
    tokenizer = processor.tokenizer
    ids: set[int] = set()
    for owner in (processor, tokenizer):
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and value != tokenizer.unk_token_id:
                ids.add(int(value))
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", True) and _VISION_TOKEN_PATTERN.match(str(token)):
            ids.add(int(token_id))
    return sorted(ids)


def image_token_types(input_ids: torch.Tensor, processor: Any) -> torch.Tensor:
    """``mm_token_type_ids`` (B, L): 1 on image placeholders, 2 on video placeholders, else 0."""
    types = torch.zeros_like(input_ids)
    types[input_ids == image_token_id(processor)] = 1
    types[input_ids == int(processor.video_token_id)] = 2
    return types


def check_image_tokens(inputs: Mapping[str, Any], row_ids: Sequence[str], *, image_token_id: int, merge_size: int) -> None:
    """Raise (naming the row) if a row's image placeholders do not match its image features.

    Each image with grid (t, h, w) yields t*h*w patches and t*h*w / merge_size**2 placeholder
    tokens. Checked before any forward pass so the failure names the data, not a kernel.
    """
    input_ids = inputs["input_ids"]
    counts = inputs.get("image_counts")
    grid = inputs.get("image_grid_thw")
    tokens_per_row = (input_ids == image_token_id).sum(-1).tolist()
    if grid is None or len(grid) == 0:
        for row_id, n_tokens in zip(row_ids, tokens_per_row):
            if n_tokens:
                raise ValueError(f"row {row_id!r}: {n_tokens} image tokens in the prompt but no image features")
        return
    if counts is None:
        raise ValueError("check_image_tokens: inputs lack 'image_counts' (images per row)")
    features_per_image = (grid.prod(-1) // (merge_size**2)).tolist()
    if int(counts.sum()) != len(features_per_image):
        raise ValueError(f"image_counts sum {int(counts.sum())} != number of image grids {len(features_per_image)}")
    start = 0
    for row_id, n_images, n_tokens in zip(row_ids, counts.tolist(), tokens_per_row):
        n_features = sum(features_per_image[start : start + n_images])
        start += n_images
        if n_tokens != n_features:
            raise ValueError(
                f"row {row_id!r}: {n_tokens} image tokens but {n_features} image features "
                f"({n_images} image(s)); was the prompt truncated or does the text contain <|image_pad|>?"
            )


def select_rows(inputs: Mapping[str, Any], index: torch.Tensor | Sequence[int]) -> BatchFeature:
    """Rows ``index`` of a batch, keeping ``pixel_values`` / ``image_grid_thw`` aligned.

    ``pixel_values`` is (num_patches, D) concatenated over all images in row order, so a
    row's patches are found from the per-image patch counts (grid t*h*w) and ``image_counts`` (plus
    ``tool_image_counts``: the images of a multi-turn completion, after the row's prompt images).
    Rows may repeat (used to repeat each prompt G times).
    """
    index = torch.as_tensor(index, dtype=torch.long)
    batch_size = inputs["input_ids"].shape[0]
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in ("pixel_values", *_PER_IMAGE_KEYS) or not isinstance(value, torch.Tensor):
            continue
        if value.shape[0] != batch_size:
            raise ValueError(f"select_rows: {key} has {value.shape[0]} rows, expected {batch_size}")
        out[key] = value[index]
    grid = inputs.get("image_grid_thw")
    if grid is not None and len(grid):
        counts = row_image_counts(inputs)
        image_start = torch.cumsum(counts, 0) - counts  # first image of each row
        patches = grid.prod(-1)
        patch_start = torch.cumsum(patches, 0) - patches  # first patch of each image
        images, patch_chunks = [], []
        for row in index.tolist():
            for image in range(int(image_start[row]), int(image_start[row] + counts[row])):
                images.append(image)
                begin = int(patch_start[image])
                patch_chunks.append(inputs["pixel_values"][begin : begin + int(patches[image])])
        if images:
            out["image_grid_thw"] = grid[torch.tensor(images, dtype=torch.long)]
            out["pixel_values"] = torch.cat(patch_chunks, 0)
    return BatchFeature(out)


def row_image_counts(inputs: Mapping[str, Any]) -> torch.Tensor:
    """(B,) images per row in ``pixel_values``: the prompt's (``image_counts``) plus, for a multi-turn rollout,
    its completion's (``tool_image_counts``: images tool answers put into the conversation)."""
    counts = inputs["image_counts"]
    extra = inputs.get("tool_image_counts")
    return counts if extra is None else counts + extra.to(counts)


def append_row_images(inputs: Mapping[str, Any], images: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]
                      ) -> BatchFeature:
    """``inputs`` with each row's extra images (``images[row]``: ``(pixel_values (patches, D), grid (3,))`` in
    the order their placeholders follow the prompt) placed after that row's images, so ``pixel_values`` and
    ``image_grid_thw`` stay in the order of the placeholders over the batch. ``tool_image_counts`` (B,) counts
    the extra images of each row (added to any it had); the prompt's own ``image_counts`` are unchanged."""
    batch_size = inputs["input_ids"].shape[0]
    if len(images) != batch_size:
        raise ValueError(f"append_row_images: {len(images)} image lists for {batch_size} rows")
    out = dict(inputs)
    previous = inputs.get("tool_image_counts")
    previous = torch.zeros(batch_size, dtype=torch.long) if previous is None else previous.long().cpu()
    extra_counts = previous + torch.tensor([len(row) for row in images], dtype=torch.long)
    if not any(images):
        out["tool_image_counts"] = extra_counts
        return BatchFeature(out)
    grid = inputs.get("image_grid_thw")
    counts = row_image_counts(inputs).tolist() if grid is not None and len(grid) else [0] * batch_size
    patches = grid.prod(-1).tolist() if grid is not None and len(grid) else []
    grids, chunks = [], []
    image, patch = 0, 0
    for row in range(batch_size):
        for _ in range(int(counts[row])):
            grids.append(grid[image])
            chunks.append(inputs["pixel_values"][patch:patch + int(patches[image])])
            patch += int(patches[image])
            image += 1
        for pixels, thw in images[row]:
            grids.append(thw.reshape(3).to(torch.long))
            chunks.append(pixels)
    dtype = inputs["pixel_values"].dtype if "pixel_values" in inputs else chunks[0].dtype
    out["pixel_values"] = torch.cat([c.to(dtype) for c in chunks], 0)
    out["image_grid_thw"] = torch.stack(grids, 0)
    out["tool_image_counts"] = extra_counts
    return BatchFeature(out)


def repeat_rows(inputs: Mapping[str, Any], times: int) -> BatchFeature:
    """Each row repeated ``times`` times, contiguously (row 0 x times, row 1 x times, ...)."""
    batch_size = inputs["input_ids"].shape[0]
    return select_rows(inputs, torch.arange(batch_size).repeat_interleave(times))


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, L) position ids of left-padded rows, as HF ``generate`` sets them: each token's count of real
    tokens before it (pad positions 1, never attended). Example: mask [0, 0, 1, 1] -> [1, 1, 0, 1]."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def model_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a Qwen-VL forward/generate accepts (drops our bookkeeping such as ``image_counts``)."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    return {key: inputs[key] for key in keys if key in inputs}


def encode_completions(
    processor: Any, completions: Sequence[str], *, add_eos: bool = True, max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize assistant completions (teacher forcing) into right-padded ``(ids, mask)`` (N, T).

    The turn's end token (``<|im_end|>``; Llama 3: ``<|eot_id|>``) is appended so the model learns to stop. ``max_length`` truncates the
    completion (text only, never the prompt).
    """
    tokenizer = processor.tokenizer
    eos = turn_end_token_id(tokenizer)
    pad = tokenizer.pad_token_id
    sequences = []
    for text in completions:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if add_eos:
            ids = ids + [eos]
        if max_length is not None:
            ids = ids[:max_length]
        sequences.append(ids)
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids, mask
