"""Per-token log-probs of completions under a VLM, without the (B, T, V) logits tensor.

The decoder runs once on ``[prompt | completion]``; the final hidden states at the
positions that predict completion tokens go through ``mmpo.core``'s chunked
``token_log_probs_from_hidden`` (gather + logsumexp per chunk, recomputed in backward),
so memory does not grow with the vocabulary (trl#2709: logits dominate GRPO memory).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import torch
from torch import Tensor

from mmpo.core.logprobs import token_log_probs_from_hidden
from mmpo.vlm.processing import padded_positions
from mmpo.vlm.fsdp import all_ranks_agree, as_root_forward, is_sharded
from mmpo.vlm.shared_prompts import shared_prompt_hidden_states

DEFAULT_LOGPROB_CHUNK = 1024


def _decoder(model: Any) -> Any:
    """The multimodal backbone that returns hidden states (``model.model`` for HF VLMs).

    A peft model is unwrapped first: its adapters live inside the transformers model (and
    ``disable_adapter`` switches them there), while ``peft_model.model`` is the whole LM.
    """
    from mmpo.training.lora import unwrap

    backbone = getattr(unwrap(model), "model", None)
    if backbone is None:
        raise TypeError(f"{type(model).__name__} has no .model backbone returning hidden states")
    return backbone


def sequence_inputs(
    prompt_inputs: Mapping[str, Any], completion_ids: Tensor, completion_mask: Tensor, *,
    image_token_id: int | None = None,
) -> dict[str, Any]:
    """Forward inputs for ``[prompt | completion]``: (N, P + T) ids, attention and token types.

    ``image_token_id``: the completion's tokens of that id are image placeholders (type 1: the images a
    multi-turn tool answer put into the conversation, ``prompt_inputs["tool_image_counts"]``); None: all text."""
    device = completion_ids.device
    prompt_ids = prompt_inputs["input_ids"].to(device)
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"{prompt_ids.shape[0]} prompts but {completion_ids.shape[0]} completions")
    inputs: dict[str, Any] = {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat(
            [prompt_inputs["attention_mask"].to(device), completion_mask.to(device, prompt_inputs["attention_mask"].dtype)],
            dim=1,
        ),
    }
    if "mm_token_type_ids" in prompt_inputs:
        types = prompt_inputs["mm_token_type_ids"].to(device)
        completion_types = torch.zeros_like(completion_ids, dtype=types.dtype)
        if image_token_id is not None:
            completion_types = (completion_ids == image_token_id).to(types.dtype)
        inputs["mm_token_type_ids"] = torch.cat([types, completion_types], dim=1)
    for key in ("pixel_values", "image_grid_thw"):
        if key in prompt_inputs and prompt_inputs[key] is not None:
            inputs[key] = prompt_inputs[key].to(device)
    return inputs


def completion_hidden_states(
    model: Any, prompt_inputs: Mapping[str, Any], completion_ids: Tensor, completion_mask: Tensor, *,
    share_prompts: bool = True,
) -> Tensor:
    """(N, T, H) final hidden states at the positions that predict each completion token.

    With ``share_prompts`` (default), rows repeating a prompt (G completions of one prompt) run it once
    (:mod:`mmpo.vlm.shared_prompts`; same values and gradients); False always runs every row in full."""
    backbone = _decoder(model)
    tool_images = prompt_inputs.get("tool_image_counts")
    image_token_id = None
    if tool_images is not None and int(tool_images.sum()) > 0:
        image_token_id = int(backbone.config.image_token_id)
    inputs = sequence_inputs(prompt_inputs, completion_ids, completion_mask, image_token_id=image_token_id)
    prompt_width = prompt_inputs["input_ids"].shape[1]
    width = completion_ids.shape[1]
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    if "pixel_values" not in inputs and not hasattr(backbone, "get_rope_index"):
        # a text LM: positions from the attention mask, as generation had them (left padding shifts no position)
        inputs["position_ids"] = padded_positions(inputs["attention_mask"])
    if share_prompts:
        # under FSDP2 every rank takes the same path (the backbone passes differ: mmpo.vlm.shared_prompts)
        agree = partial(all_ranks_agree, model) if is_sharded(model) else None
        shared = shared_prompt_hidden_states(backbone, inputs, prompt_inputs, prompt_width, width, agree=agree)
        if shared is not None:
            return shared
    outputs = backbone(**inputs, use_cache=False)
    hidden = outputs.last_hidden_state
    # position p predicts token p + 1: completion token j is predicted at prompt_width - 1 + j
    return hidden[:, prompt_width - 1 : prompt_width - 1 + width]


def completion_log_probs(
    model: Any,
    prompt_inputs: Mapping[str, Any],
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    chunk_size: int = DEFAULT_LOGPROB_CHUNK,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Log pi(completion token | prompt, previous tokens) for every completion position.

    Args:
        model: HF VLM (``...ForConditionalGeneration``) with ``.model`` and an output embedding.
        prompt_inputs: left-padded prompt batch (``input_ids`` (N, P), ``attention_mask``,
            ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``).
        completion_ids: (N, T) sampled tokens (pad where masked).
        completion_mask: (N, T) 1 on real completion tokens; also the attention mask of the
            completion part (masked tokens are neither scored nor attended to).
        chunk_size: rows of (N*T) per chunk of the vocabulary projection.
        with_entropy: also return the (N, T) entropy of the full next-token distribution.
        temperature: logits are divided by the rollout's sampling temperature, so the
            log-probs are those of the distribution the tokens were sampled from (as verl).

    Returns:
        ``(log_probs (N, T) float32, entropy (N, T) float32 or None)``; masked positions
        hold whatever the model computes there (mask them in the loss).
    """
    # under FSDP2 the backbone and lm_head are used outside model.forward: run as the root's forward
    return as_root_forward(model, _completion_log_probs, model, prompt_inputs, completion_ids, completion_mask,
                           chunk_size=chunk_size, with_entropy=with_entropy, temperature=temperature)


def _completion_log_probs(
    model: Any,
    prompt_inputs: Mapping[str, Any],
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    chunk_size: int,
    with_entropy: bool,
    temperature: float,
) -> tuple[Tensor, Tensor | None]:
    hidden = completion_hidden_states(model, prompt_inputs, completion_ids, completion_mask)
    head = model.get_output_embeddings()
    result = token_log_probs_from_hidden(
        hidden,
        head.weight,
        completion_ids.to(hidden.device),
        chunk_size=chunk_size,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        return_entropy=with_entropy,
    )
    if with_entropy:
        log_probs, entropy = result
        return log_probs, entropy
    return result, None


@torch.no_grad()
def completion_token_statistics(
    model: Any,
    prompt_inputs: Mapping[str, Any],
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    chunk_size: int = DEFAULT_LOGPROB_CHUNK,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(log pi of each completion token, sum_v pi_v^2) at every completion position, no gradient.

    The optimal token baseline's inputs (``advantage: optimal_token_baseline``): the squared
    norm of the softmax score is 1 - 2 pi_t + sum_v pi_v^2. Chunked over positions like
    :func:`completion_log_probs`, so the full (N, T, V) tensor never exists.

    Returns:
        ``(log_probs (N, T) float32, sum_pi_squared (N, T) float32)``.
    """
    return as_root_forward(model, _completion_token_statistics, model, prompt_inputs, completion_ids,
                           completion_mask, chunk_size=chunk_size, temperature=temperature)


def _completion_token_statistics(
    model: Any, prompt_inputs: Mapping[str, Any], completion_ids: Tensor, completion_mask: Tensor, *,
    chunk_size: int, temperature: float,
) -> tuple[Tensor, Tensor]:
    hidden = completion_hidden_states(model, prompt_inputs, completion_ids, completion_mask)
    head = model.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens = completion_ids.to(hidden.device).reshape(-1, 1)
    log_probs, sum_squares = [], []
    for start in range(0, flat.shape[0], chunk_size):
        logits = torch.nn.functional.linear(flat[start : start + chunk_size], head.weight, getattr(head, "bias", None))
        log_softmax = (logits.float() / temperature).log_softmax(-1)
        log_probs.append(log_softmax.gather(-1, tokens[start : start + chunk_size]).squeeze(-1))
        sum_squares.append((2.0 * log_softmax).exp().sum(-1))
    shape = completion_ids.shape
    return torch.cat(log_probs).reshape(shape), torch.cat(sum_squares).reshape(shape)
