"""Sequence log-probs of a masked-diffusion LM for the preference losses of ``mmpo.core``.

A masked-diffusion LM has no exact sequence likelihood; the one-pass estimator of
``mmpo.dllm.logprobs.completion_log_probs`` (d1 / IGPO: every completion position masked, one forward)
gives per-token log-probs, and their sum over a completion's real tokens is the sequence
log-prob that ``mmpo.core.preference_loss`` (DPO family) and ``mmpo.core.inpo_loss`` take. Use the
same ``seed`` (prompt masking) for the policy and the reference so both score the same corruption.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmpo.dllm.logprobs import completion_log_probs


def sequence_log_probs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    completions: Tensor,
    completion_mask: Tensor,
    *,
    mask_token_id: int,
    p_mask_prompt: float = 0.0,
    seed: int | None = None,
) -> Tensor:
    """(batch,) estimated log pi(completion | prompt): per-token one-pass log-probs summed over
    ``completion_mask`` (batch, L) (1 on real completion tokens, 0 on padding)."""
    log_probs, _ = completion_log_probs(model, prompt_ids, prompt_attention_mask, completions,
                                        mask_token_id=mask_token_id, p_mask_prompt=p_mask_prompt, seed=seed)
    return (log_probs * completion_mask.to(log_probs)).sum(-1)
