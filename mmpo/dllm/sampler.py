"""LLaDA's semi-autoregressive block sampler with fixed (hint) positions.

Reference: LLaDA (arXiv 2502.09992), ``ML-GSAI/LLaDA:generate.py``; IGPO's inpainting
variant (arXiv 2509.10396, ``facebookresearch/igpo:utils/generate.py``). Algorithm:

1. canvas = [prompt ; L masks]; optional hint tokens are written into the completion and
   marked *fixed*: they are never masked, never overwritten and never counted in the
   commit schedule;
2. the completion is split into ``L / block_length`` blocks decoded left to right,
   ``steps / num_blocks`` steps per block;
3. per block and row, the masked (non-fixed) positions are spread evenly over the steps:
   ``diffusers.BlockRefinementScheduler.get_num_transfer_tokens`` gives the schedule;
4. each step runs the model on the whole canvas, samples a candidate at every position
   by Gumbel-max in float64 at temperature tau, and commits the k most confident masked
   positions of the current block (confidence = untempered softmax probability of the
   candidate, LLaDA's ``low_confidence`` remasking; ``random`` uses uniform scores).

Why not ``BlockRefinementScheduler.step`` / ``LLaDA2Pipeline`` for the step itself:
``step`` samples with ``torch.multinomial`` in float32 and scores confidence with the
*tempered* probability (LLaDA: float64 Gumbel-max, untempered confidence), it applies one
commit schedule to the whole batch (hint positions make the per-row count of masked
positions differ, so rows need their own schedules), and it has no notion of fixed
positions. ``LLaDA2Pipeline`` is LLaDA2's block-causal variant (the model sees only the
blocks up to the current one, blocks aligned to absolute positions, threshold commits
and editing), not LLaDA/IGPO's full-canvas sampler. We reuse the scheduler's schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import BlockRefinementScheduler
from torch import Tensor

from mmpo.dllm.modeling import mask_predictor_logits


@dataclass
class SamplerConfig:
    """LLaDA block-sampler settings (IGPO rollouts: L 256, block 32, steps L/2, temperature 1.2)."""

    gen_length: int = 32
    """completion length L (a multiple of block_length)"""
    block_length: int = 8
    """tokens per semi-autoregressive block"""
    steps: int = 16
    """total denoising steps over the completion (a multiple of L / block_length)"""
    temperature: float = 1.2
    """Gumbel-max temperature; 0 = greedy argmax"""
    remasking: str = "low_confidence"
    """which masked positions to commit: 'low_confidence' (most confident first) or 'random'"""

    def __post_init__(self) -> None:
        if self.gen_length <= 0 or self.block_length <= 0 or self.steps <= 0:
            raise ValueError(f"gen_length, block_length and steps must be positive, got {self}")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length {self.gen_length} is not a multiple of block_length {self.block_length}")
        num_blocks = self.gen_length // self.block_length
        if self.steps % num_blocks:
            raise ValueError(f"steps {self.steps} is not a multiple of the number of blocks {num_blocks}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.remasking not in ("low_confidence", "random"):
            raise ValueError(f"remasking must be 'low_confidence' or 'random', got {self.remasking!r}")


@dataclass
class SamplerOutput:
    """Result of :func:`generate`.

    Attributes:
        completions: ``(batch, L)`` generated tokens (hints included at their positions).
        fixed_mask: ``(batch, L)`` True at hint positions.
        commits: ``(total_steps, batch)`` number of tokens committed at each step (for checks).
        committed_block: ``(total_steps,)`` index of the block each step worked on.
    """

    completions: Tensor
    fixed_mask: Tensor
    commits: Tensor
    committed_block: Tensor


def gumbel_max_sample(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Sample from softmax(logits / temperature) by Gumbel-max in float64.

    LLaDA computes ``argmax(exp(logits) / (-log U)^tau)``; we take the log of that,
    ``argmax(logits - tau * log(-log U))``, the same argmax without overflow in ``exp``.
    float64 matters: low-precision Gumbel noise degrades samples (LLaDA's comment).

    Args:
        logits: ``(..., vocab)``.
    Returns:
        ``(...)`` sampled token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits64 = logits.to(torch.float64)
    uniform = torch.rand(logits64.shape, dtype=torch.float64, device=logits.device, generator=generator)
    # Keep U away from 0 and 1 so log(-log U) stays finite.
    uniform = uniform.clamp(min=1e-300, max=1.0 - 1e-16)
    return (logits64 - temperature * torch.log(-torch.log(uniform))).argmax(dim=-1)


def row_transfer_schedule(num_masked: Tensor, steps: int, scheduler: BlockRefinementScheduler) -> Tensor:
    """``(batch,) -> (batch, steps)`` commits per step: an even split, the remainder first.

    Uses ``BlockRefinementScheduler.get_num_transfer_tokens`` per row (its own batch-wide
    schedule cannot express rows with different numbers of fixed positions).
    """
    return torch.stack([scheduler.get_num_transfer_tokens(int(m), steps) for m in num_masked.tolist()])


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_attention_mask: Tensor,
    config: SamplerConfig,
    *,
    mask_token_id: int,
    fixed_tokens: Tensor | None = None,
    fixed_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Generate completions with LLaDA's block sampler, keeping hint positions fixed.

    Args:
        model: mask predictor (``model(input_ids, attention_mask).logits``).
        prompt_ids: ``(batch, P)`` left-padded prompt ids.
        prompt_attention_mask: ``(batch, P)`` 1 for real prompt tokens.
        config: sampler settings.
        mask_token_id: the ``[MASK]`` id.
        fixed_tokens: ``(batch, L)`` hint tokens (read only where ``fixed_mask``).
        fixed_mask: ``(batch, L)`` True where the completion holds a fixed hint token.
        generator: RNG for Gumbel noise / random remasking (reproducible under a seed).

    Returns:
        :class:`SamplerOutput`.
    """
    batch, prompt_len = prompt_ids.shape
    length, block = config.gen_length, config.block_length
    device = prompt_ids.device
    if fixed_mask is None:
        fixed_mask = torch.zeros((batch, length), dtype=torch.bool, device=device)
    if fixed_mask.shape != (batch, length):
        raise ValueError(f"fixed_mask shape {tuple(fixed_mask.shape)} != (batch, gen_length) {(batch, length)}")
    if fixed_mask.any():
        if fixed_tokens is None or fixed_tokens.shape != (batch, length):
            raise ValueError("fixed_tokens of shape (batch, gen_length) is required where fixed_mask is set")
        if bool((fixed_tokens[fixed_mask] == mask_token_id).any()):
            raise ValueError("a fixed (hint) position holds the mask token")

    completion = torch.full((batch, length), mask_token_id, dtype=torch.long, device=device)
    if fixed_mask.any():
        completion = torch.where(fixed_mask, fixed_tokens, completion)
    canvas = torch.cat([prompt_ids, completion], dim=1)
    attention = torch.cat([prompt_attention_mask.long(), torch.ones((batch, length), dtype=torch.long, device=device)], 1)

    num_blocks = length // block
    steps_per_block = config.steps // num_blocks
    scheduler = BlockRefinementScheduler(block_length=block, num_inference_steps=steps_per_block)
    commits, committed_block = [], []
    for block_index in range(num_blocks):
        start = prompt_len + block_index * block
        end = start + block
        # Fixed positions are not mask tokens, so they are excluded from the schedule here.
        block_masked = canvas[:, start:end] == mask_token_id
        schedule = row_transfer_schedule(block_masked.sum(dim=1), steps_per_block, scheduler).to(device)
        for step in range(steps_per_block):
            logits = mask_predictor_logits(model, canvas, attention)
            # Never propose the mask token itself: a committed [MASK] would stay masked forever.
            logits = logits.clone()
            logits[..., mask_token_id] = -torch.inf
            candidates = gumbel_max_sample(logits, config.temperature, generator)
            if config.remasking == "low_confidence":
                probs = torch.softmax(logits.to(torch.float64), dim=-1)
                confidence = probs.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
            else:
                confidence = torch.rand(candidates.shape, dtype=torch.float64, device=device, generator=generator)
            is_mask = canvas == mask_token_id
            in_block = torch.zeros_like(is_mask)
            in_block[:, start:end] = True
            confidence = torch.where(is_mask & in_block, confidence, torch.full_like(confidence, -torch.inf))
            transfer = torch.zeros_like(is_mask)
            for row in range(batch):
                k = int(schedule[row, step])
                if k > 0:
                    transfer[row, torch.topk(confidence[row], k).indices] = True
            canvas = torch.where(transfer, candidates, canvas)
            commits.append(transfer.sum(dim=1))
            committed_block.append(block_index)

    completions = canvas[:, prompt_len:]
    return SamplerOutput(
        completions=completions,
        fixed_mask=fixed_mask.clone(),
        commits=torch.stack(commits) if commits else torch.zeros((0, batch), dtype=torch.long),
        committed_block=torch.tensor(committed_block, dtype=torch.long),
    )
