"""One forward per distinct prompt in the training forward: the G completions of a prompt share it.

A GRPO batch repeats each prompt (its tokens and its images) G times. The decoder's states over the
prompt are the same in every copy (causal attention: the prompt never sees its completion), so the
prompt runs once per distinct prompt, its KV cache is indexed out to the N rows
(``Cache.batch_select_indices``, differentiable), and only the completion tokens run per row. The
gradient reaching the shared prompt states is the sum over the copies', which is what the per-row
path computes, so values and gradients agree up to float rounding (tests/vlm/test_shared_prompts.py).

Used for Qwen-VL backbones on batches with images and repeated prompts (their 3-D RoPE positions come
from ``get_rope_index`` over the full sequence, sliced into the prompt and completion parts) and for text
LMs (Qwen2 / Qwen3 / Llama: the mask-aware positions the plain forward uses, sliced the same way); anything
else (a VLM's text-only batch, gradient checkpointing) takes the plain one-forward path.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor
from transformers import DynamicCache


def distinct_prompt_rows(prompt_inputs: Mapping[str, Any]) -> tuple[list[int], list[int]] | None:
    """(first row of each distinct prompt, for each row its distinct prompt's position), or None for an image
    batch without the per-row image bookkeeping (``image_counts``). Rows are equal when their prompt tokens,
    attention mask and images (grid and pixels; none in a text batch) are. Example: rows [A, A, B, A] ->
    ([0, 2], [0, 0, 1, 0])."""
    ids, mask = prompt_inputs["input_ids"], prompt_inputs["attention_mask"]
    if prompt_inputs.get("pixel_values") is None and prompt_inputs.get("image_grid_thw") is None:
        def same(a: int, b: int) -> bool:  # a text batch: the tokens and the mask say it all
            return torch.equal(ids[a], ids[b]) and torch.equal(mask[a], mask[b])
    else:
        grid, counts = prompt_inputs.get("image_grid_thw"), prompt_inputs.get("image_counts")
        if grid is None or counts is None:
            return None
        patches = grid.prod(-1)
        patch_start = (torch.cumsum(patches, 0) - patches).tolist()
        image_start = (torch.cumsum(counts, 0) - counts).tolist()
        pixels = prompt_inputs["pixel_values"]

        def images(row: int) -> list[tuple[Tensor, Tensor]]:
            first = int(image_start[row])
            return [(grid[i], pixels[patch_start[i] : patch_start[i] + int(patches[i])])
                    for i in range(first, first + int(counts[row]))]

        def same(a: int, b: int) -> bool:
            if not (torch.equal(ids[a], ids[b]) and torch.equal(mask[a], mask[b])
                    and int(counts[a]) == int(counts[b])):
                return False
            return all(torch.equal(ga, gb) and torch.equal(pa, pb)
                       for (ga, pa), (gb, pb) in zip(images(a), images(b)))

    first: list[int] = []
    inverse: list[int] = []
    for row in range(ids.shape[0]):
        # repeats of a prompt are usually adjacent: look at the latest distinct prompts first
        match = next((k for k in reversed(range(len(first))) if same(first[k], row)), None)
        if match is None:
            first.append(row)
            match = len(first) - 1
        inverse.append(match)
    return first, inverse


def _shareable_rows(backbone: Any, inputs: Mapping[str, Any], prompt_inputs: Mapping[str, Any],
                    width: int) -> tuple[list[int], list[int]] | None:
    """:func:`distinct_prompt_rows` when this batch and backbone qualify for the shared forward, else None."""
    vision = "pixel_values" in inputs and hasattr(backbone, "get_rope_index")
    text_lm = "pixel_values" not in inputs and not hasattr(backbone, "get_rope_index") and "position_ids" in inputs
    if not (vision or text_lm) or width < 1:
        return None
    if backbone.training and any(getattr(m, "gradient_checkpointing", False) for m in backbone.modules()):
        return None  # HF turns use_cache off under gradient checkpointing: the prompt's cache would stay empty
    tool_images = prompt_inputs.get("tool_image_counts")
    if tool_images is not None and int(tool_images.sum()) > 0:
        return None  # images inside the completions (multi-turn tool answers): the plain forward places them
    rows = distinct_prompt_rows(prompt_inputs)
    if rows is None or len(rows[0]) == len(rows[1]):
        return None
    return rows


def shared_prompt_hidden_states(backbone: Any, inputs: Mapping[str, Any], prompt_inputs: Mapping[str, Any],
                                prompt_width: int, width: int, *,
                                agree: Callable[[bool], bool] | None = None) -> Tensor | None:
    """(N, T, H) hidden states predicting each completion token, the prompt run once per distinct prompt;
    None when this batch or backbone does not qualify (then run the plain forward).

    ``inputs`` is :func:`mmpo.vlm.logprobs.sequence_inputs`' output for ``[prompt | completion]``.

    ``agree`` (FSDP2, :func:`mmpo.vlm.fsdp.all_ranks_agree`): called once, on every rank, with whether
    this rank's batch qualifies; the shared forward runs only when it returns True (every rank
    qualifies). The shared forward calls the backbone twice (prompts, then completions), the plain one
    once, and under FSDP2 each backbone call all-gathers every decoder layer: ranks taking different
    paths would run different collectives (an image batch beside a text-only one: a hang, or worse,
    one layer's shards exchanged for another's). Under ``agree`` a batch qualifies only with
    completions of two or more tokens (one token skips the completion pass)."""
    from mmpo.vlm.processing import select_rows

    rows = _shareable_rows(backbone, inputs, prompt_inputs, width)
    if agree is not None and not agree(rows is not None and width >= 2):
        return None
    if rows is None:
        return None
    first, inverse = rows
    device = inputs["input_ids"].device
    index = torch.tensor(first, device=device)
    if "pixel_values" in inputs:
        # 3-D RoPE positions (3, N, L) of the full sequences, exactly as the plain forward computes them
        positions, _ = backbone.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                               image_grid_thw=inputs["image_grid_thw"],
                                               attention_mask=inputs["attention_mask"])
        distinct = select_rows(prompt_inputs, first)
        prompt_extra = {"mm_token_type_ids": inputs["mm_token_type_ids"][index, :prompt_width],
                        "pixel_values": distinct["pixel_values"].to(device, inputs["pixel_values"].dtype),
                        "image_grid_thw": distinct["image_grid_thw"].to(device)}
        completion_extra = {"mm_token_type_ids": inputs["mm_token_type_ids"][:, prompt_width : prompt_width + width - 1]}
    else:  # a text LM: the mask-aware (N, L) positions the plain forward runs with
        positions, prompt_extra, completion_extra = inputs["position_ids"], {}, {}
    cache = DynamicCache(config=backbone.config)
    prompt_out = backbone(
        input_ids=inputs["input_ids"][index, :prompt_width], attention_mask=inputs["attention_mask"][index, :prompt_width],
        position_ids=positions[..., index, :prompt_width], cache=cache, use_cache=True, **prompt_extra,
    )
    rows_of = torch.tensor(inverse, device=device)
    cache.batch_select_indices(rows_of)  # each row gets its prompt's keys / values (indexing: differentiable)
    last_prompt = prompt_out.last_hidden_state[rows_of, prompt_width - 1 :]  # predicts completion token 0
    if width == 1:
        return last_prompt
    completion_out = backbone(
        input_ids=inputs["input_ids"][:, prompt_width : prompt_width + width - 1],
        attention_mask=inputs["attention_mask"][:, : prompt_width + width - 1],
        position_ids=positions[..., prompt_width : prompt_width + width - 1], cache=cache, use_cache=True,
        **completion_extra,
    )
    return torch.cat([last_prompt, completion_out.last_hidden_state], dim=1)
