"""Generation that continues from a partial completion: the primitive of structured rollouts.

TreePO grows a path one segment at a time, Segment-PO estimates Monte Carlo values from the
prefix at each cut point, BRPO samples summaries after a truncated thinking trace, and T-PPO
continues a response window by window. All four need "sample from (prompt + tokens so far)".

The prefix goes into the prompt (:func:`extend_prompts`): the returned :class:`~mmpo.vlm.rollout.Rollout`
has ``prompt_inputs`` = prompt + prefix and ``completion_ids`` = only the new tokens, so its
log-probs and its loss cover the new tokens, with the prefix as (attended) context: the trainer's
``completion_mask`` doubles as the attention mask, so an untrained prefix cannot live in the
completion. The engine's own :meth:`~mmpo.vlm.rollout.HFGenerateEngine.generate` encodes prompts
from rows; this module calls the same ``model.generate`` on already-encoded inputs and post-processes
like the engine (vision tokens end a completion; ids after EOS become pad).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor
from transformers import BatchFeature

from mmpo.vlm.processing import model_inputs
from mmpo.vlm.rollout import HFGenerateEngine, Rollout, completion_mask_from_ids

_TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def extend_prompts(prompt_inputs: Mapping[str, Any], prefix_ids: Tensor, prefix_mask: Tensor,
                   *, pad_token_id: int) -> BatchFeature:
    """Row i's prompt followed by its prefix tokens (``prefix_mask`` 1), re-left-padded.

    Images (``pixel_values``, ``image_grid_thw``, ``image_counts``) are unchanged: the prefix is text.
    Example: prompt rows [pad, p1, p2] and [q1, q2, q3] with prefixes [a] and [b, c] ->
    [pad, pad, p1, p2, a] and [q1, q2, q3, b, c].
    """
    ids = prompt_inputs["input_ids"]
    attention = prompt_inputs["attention_mask"]
    if prefix_ids.shape[0] != ids.shape[0] or prefix_mask.shape != prefix_ids.shape:
        raise ValueError(f"extend_prompts: {ids.shape[0]} prompts, prefix ids {tuple(prefix_ids.shape)}, "
                         f"mask {tuple(prefix_mask.shape)}")
    types = prompt_inputs.get("mm_token_type_ids")
    rows_ids, rows_types = [], []
    for i in range(ids.shape[0]):
        keep = attention[i] > 0
        prefix = prefix_ids[i][prefix_mask[i] > 0].to(ids)
        rows_ids.append(torch.cat([ids[i][keep], prefix]))
        if types is not None:
            rows_types.append(torch.cat([types[i][keep], torch.zeros_like(prefix, dtype=types.dtype)]))
    width = max(len(r) for r in rows_ids)
    out = {key: value for key, value in prompt_inputs.items() if key not in _TOKEN_KEYS}
    out["input_ids"] = torch.full((len(rows_ids), width), pad_token_id, dtype=ids.dtype)
    out["attention_mask"] = torch.zeros((len(rows_ids), width), dtype=attention.dtype)
    if types is not None:
        out["mm_token_type_ids"] = torch.zeros((len(rows_ids), width), dtype=types.dtype)
    for i, row in enumerate(rows_ids):
        out["input_ids"][i, width - len(row):] = row
        out["attention_mask"][i, width - len(row):] = 1
        if types is not None:
            out["mm_token_type_ids"][i, width - len(row):] = rows_types[i]
    return BatchFeature(out)


def join_completions(first_ids: Tensor, first_mask: Tensor, second_ids: Tensor, second_mask: Tensor,
                     *, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Row-wise ``first[mask] + second[mask]``, right-padded: ``(ids, mask)`` (N, T)."""
    rows = [torch.cat([a[ma > 0], b[mb > 0]]) for a, ma, b, mb in zip(first_ids, first_mask, second_ids, second_mask)]
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=first_ids.dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


@torch.no_grad()
def generate_from_inputs(
    engine: HFGenerateEngine,
    rows: Sequence[Mapping[str, Any]],
    prompt_inputs: Mapping[str, Any],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    group_ids: Tensor | None = None,
) -> Rollout:
    """One sampled continuation per row of already-encoded ``prompt_inputs`` (e.g. :func:`extend_prompts`).

    Sampling and post-processing match :meth:`HFGenerateEngine.generate` (top_k 0, the engine's EOS and
    pad ids, vision special tokens suppressed, and still a guard: one ends the completion). ``group_ids`` defaults to ``arange(len(rows))``.
    Repeat a row in ``rows`` / ``prompt_inputs`` (``select_rows``) to draw several continuations of it.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    rows = list(rows)
    if len(rows) != prompt_inputs["input_ids"].shape[0]:
        raise ValueError(f"{len(rows)} rows but {prompt_inputs['input_ids'].shape[0]} prompts")
    model = engine.model
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in model_inputs(prompt_inputs).items()}
    was_training = model.training
    model.eval()
    try:
        output = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
            eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id, use_cache=True,
            suppress_tokens=engine.suppressed_token_ids(),  # vision specials never sampled, as in the engine
        )
    finally:
        model.train(was_training)
    completion_ids = output[:, inputs["input_ids"].shape[1]:].cpu()
    if completion_ids.shape[1] == 0:
        completion_ids = torch.full((completion_ids.shape[0], 1), engine.pad_token_id, dtype=torch.long)
    completion_mask = completion_mask_from_ids(completion_ids, eos_token_id=engine.eos_token_id,
                                               forbidden_ids=engine.forbidden_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, engine.pad_token_id)
    texts = engine.processor.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(
        rows=rows,
        group_ids=torch.arange(len(rows)) if group_ids is None else group_ids,
        prompt_inputs=BatchFeature(dict(prompt_inputs)),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        texts=texts,
    )


def ended(rollout: Rollout, eos_token_id: int) -> Tensor:
    """``(N,)`` bool: the completion stopped inside its budget (an EOS, or a vision token that ended it)."""
    has_eos = ((rollout.completion_ids == eos_token_id) & (rollout.completion_mask > 0)).any(-1)
    # a vision token masks the rest of the row: a masked position before the last column
    # with no EOS means the row was cut by a forbidden token
    cut = (rollout.completion_mask == 0).any(-1) & ~has_eos
    return has_eos | cut


def continue_rollout(
    engine: HFGenerateEngine,
    base: Rollout,
    index: Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Rollout:
    """One continuation of each completion ``index`` of ``base`` (repeats allowed): the prompt is
    ``base``'s prompt + that completion's tokens; rows and group ids are ``base``'s."""
    index = torch.as_tensor(index, dtype=torch.long)
    part = base.select(index)
    prompts = extend_prompts(part.prompt_inputs, part.completion_ids, part.completion_mask,
                             pad_token_id=engine.pad_token_id)
    return generate_from_inputs(engine, part.rows, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, group_ids=part.group_ids)


__all__ = ["continue_rollout", "ended", "extend_prompts", "generate_from_inputs", "join_completions"]
