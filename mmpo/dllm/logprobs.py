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

IGPO's code has a second estimator (``d1_masking: false`` in ``facebookresearch/igpo``,
``structured_timestep_sampling`` / ``grpo_forward_process``): inner iteration n masks each
completion token with probability t_n / T, where t_0 ~ U{30, ..., T-2} and the other
mu - 1 timesteps are spread evenly from t_0 up to T; the loss then covers only the masked
positions. Tokens are scored with part of the completion visible, which is closer to what
the block sampler conditions on than the fully masked canvas (``structured_timesteps`` and
``completion_mask_ratio`` below).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmpo.dllm.modeling import mask_predictor_logits
from mmpo.core import entropy_from_logits, token_log_probs


def structured_timesteps(
    num_iterations: int, diffusion_steps: int, min_timestep: int = 30, generator: torch.Generator | None = None
) -> list[int]:
    """IGPO's structured timestep schedule for the mu inner iterations (``d1_masking: false``).

    t_0 ~ U{min_timestep, ..., T - 2}; t_n = floor(n / (mu - 1) * (T - t_0) + t_0) for n >= 1, so the
    last iteration masks the whole completion. Mask ratio of iteration n = t_n / T.
    """
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
    if not 1 <= min_timestep <= diffusion_steps - 2:
        raise ValueError(f"need 1 <= min_timestep <= diffusion_steps - 2, got {min_timestep} and {diffusion_steps}")
    t0 = int(torch.randint(min_timestep, diffusion_steps - 1, (1,), generator=generator))
    return [t0] + [math.floor(n / (num_iterations - 1) * (diffusion_steps - t0) + t0) for n in range(1, num_iterations)]


def perturb_for_scoring(
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    completions: Tensor,
    *,
    mask_token_id: int,
    p_mask_prompt: float = 0.0,
    completion_mask_ratio: float = 1.0,
    seed: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The scoring canvas: prompt (randomly masked with ``p_mask_prompt``) + masked completion.

    Args:
        prompt_ids: ``(batch, P)`` left-padded.
        prompt_attention_mask: ``(batch, P)`` 1 for real tokens (padding is never masked).
        completions: ``(batch, L)``.
        p_mask_prompt: probability of masking each real prompt token.
        completion_mask_ratio: probability of masking each completion token (1: all, d1's estimator).
        seed: seeds both random masks (same seed -> same masks).

    Returns:
        ``(input_ids (batch, P + L), attention_mask (batch, P + L), masked (batch, L) bool)``:
        ``masked`` marks the completion positions that were masked (the ones to score).
    """
    if not 0.0 <= p_mask_prompt < 1.0:
        raise ValueError(f"p_mask_prompt must be in [0, 1), got {p_mask_prompt}")
    if not 0.0 < completion_mask_ratio <= 1.0:
        raise ValueError(f"completion_mask_ratio must be in (0, 1], got {completion_mask_ratio}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(0 if seed is None else int(seed))
    prompt = prompt_ids.clone()
    if p_mask_prompt > 0:
        draw = torch.rand(prompt.shape, generator=generator).to(prompt.device)
        prompt_mask = (draw < p_mask_prompt) & prompt_attention_mask.bool()
        prompt = torch.where(prompt_mask, torch.full_like(prompt, mask_token_id), prompt)
    if completion_mask_ratio < 1.0:
        masked = torch.rand(completions.shape, generator=generator).to(completions.device) < completion_mask_ratio
    else:
        masked = torch.ones_like(completions, dtype=torch.bool)
    noisy_completion = torch.where(masked, torch.full_like(completions, mask_token_id), completions)
    input_ids = torch.cat([prompt, noisy_completion], dim=1)
    attention = torch.cat([prompt_attention_mask.long(), torch.ones_like(completions)], dim=1)
    return input_ids, attention, masked


def completion_log_probs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    completions: Tensor,
    *,
    mask_token_id: int,
    p_mask_prompt: float = 0.0,
    completion_mask_ratio: float = 1.0,
    seed: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
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
        completion_mask_ratio: probability of masking each completion token (1: the one-pass
            estimator; < 1: IGPO's structured estimator, where only masked positions are scored,
            see ``perturb_for_scoring`` for which).
        seed: masking seed; use the same one for old and new log-probs.
        with_entropy: also return the per-position entropy (of the mask predictor's distribution at each
            completion position, i.e. at the masked positions of this pass).
        entropy_grad: let the gradient flow through that entropy (an entropy term in the loss, EPO's);
            by default it is detached (a filter or loss input only).
        chunk_size: rows per chunk in the log-softmax (memory bound).

    Returns:
        ``(log_probs (batch, L), entropy (batch, L) or None)``; differentiable when grad is on.
    """
    input_ids, attention, _ = perturb_for_scoring(
        prompt_ids, prompt_attention_mask, completions, mask_token_id=mask_token_id, p_mask_prompt=p_mask_prompt,
        completion_mask_ratio=completion_mask_ratio, seed=seed,
    )
    logits = mask_predictor_logits(model, input_ids, attention)[:, prompt_ids.shape[1] :]
    log_probs = token_log_probs(logits, completions, chunk_size)
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), chunk_size) if with_entropy else None
    return log_probs, entropy
