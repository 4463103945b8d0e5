"""One-pass (mean-field) per-token log-probs of a masked-diffusion LM.

diffu-GRPO (d1, arXiv 2504.12216, ``dllm-reasoning/d1:diffu-grpo/diffu_grpo_trainer.py``
``forward_process`` / ``_get_per_token_logps``) and IGPO (arXiv 2509.10396):

- mask every completion position (hint tokens included: IGPO scores them like generated
  tokens), optionally mask each real prompt token with probability ``p_mask_prompt``
  (d1: 0.15; IGPO: 0, the prompt stays visible);
- one forward pass; ``log pi(o_j | q') = log_softmax(logits_j)[o_j]`` at every completion
  position, plus the entropy of that distribution (IGPO's hint filter uses it).

The prompt mask is drawn from a seed, so old and new log-probs of one inner iteration see
the same masked prompt (d1 draws one seed per inner iteration).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dllm.modeling import mask_predictor_logits
from mmpo.core import entropy_from_logits, token_log_probs


def perturb_for_scoring(
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    completions: Tensor,
    *,
    mask_token_id: int,
    p_mask_prompt: float = 0.0,
    seed: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The scoring canvas: prompt (randomly masked with ``p_mask_prompt``) + fully masked completion.

    Args:
        prompt_ids: ``(batch, P)`` left-padded.
        prompt_attention_mask: ``(batch, P)`` 1 for real tokens (padding is never masked).
        completions: ``(batch, L)``.
        seed: seeds the prompt masking (same seed -> same mask).

    Returns:
        ``(input_ids (batch, P + L), attention_mask (batch, P + L))``.
    """
    if not 0.0 <= p_mask_prompt < 1.0:
        raise ValueError(f"p_mask_prompt must be in [0, 1), got {p_mask_prompt}")
    prompt = prompt_ids.clone()
    if p_mask_prompt > 0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0 if seed is None else int(seed))
        draw = torch.rand(prompt.shape, generator=generator).to(prompt.device)
        prompt_mask = (draw < p_mask_prompt) & prompt_attention_mask.bool()
        prompt = torch.where(prompt_mask, torch.full_like(prompt, mask_token_id), prompt)
    masked_completion = torch.full_like(completions, mask_token_id)
    input_ids = torch.cat([prompt, masked_completion], dim=1)
    attention = torch.cat([prompt_attention_mask.long(), torch.ones_like(completions)], dim=1)
    return input_ids, attention


def completion_log_probs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    completions: Tensor,
    *,
    mask_token_id: int,
    p_mask_prompt: float = 0.0,
    seed: int | None = None,
    with_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies) of ``completions`` by the one-pass estimator.

    Args:
        model: mask predictor.
        prompt_ids: ``(batch, P)``.
        prompt_attention_mask: ``(batch, P)``.
        completions: ``(batch, L)`` token ids to score.
        mask_token_id: the ``[MASK]`` id.
        p_mask_prompt: probability of masking each prompt token (d1: 0.15, IGPO: 0).
        seed: prompt-masking seed; use the same one for old and new log-probs.
        with_entropy: also return the per-position entropy.
        chunk_size: rows per chunk in the log-softmax (memory bound).

    Returns:
        ``(log_probs (batch, L), entropy (batch, L) or None)``; differentiable when grad is on.
    """
    input_ids, attention = perturb_for_scoring(
        prompt_ids, prompt_attention_mask, completions, mask_token_id=mask_token_id, p_mask_prompt=p_mask_prompt, seed=seed
    )
    logits = mask_predictor_logits(model, input_ids, attention)[:, prompt_ids.shape[1] :]
    log_probs = token_log_probs(logits, completions, chunk_size)
    entropy = entropy_from_logits(logits.detach(), chunk_size) if with_entropy else None
    return log_probs, entropy
