"""IGPO hint construction: reveal chunks of the reference trace at stretched positions.

IGPO (arXiv 2509.10396), ``facebookresearch/igpo:utils/generate.py``
(``create_spacing_scaled_inpainting_sequence``); the facts with their sources are in
``docs/algorithm_sources.md`` section 17.3:

1. tokenize the reference trace; the hint area is the first ``L - free_tail`` completion
   positions (the official code keeps the last 30 free); truncate the trace to it; with
   ``trace_free_tail > 0`` (ours, 0 in the official code) the last tokens of the trace itself
   are never revealed either: when the trace is shorter than the canvas (short synthetic
   traces), the canvas tail rule alone leaves the final answer revealable, and a "correct"
   hinted rollout may then only have copied it;
2. cut the trace left to right into chunks of ``U{min_chunk, max_chunk}`` tokens; a
   trailing piece shorter than ``min_chunk`` is never revealed;
3. hide ``floor(n_chunks * (1 - eta))`` chunks chosen at random, reveal the rest;
4. stretch positions by ``s = clip((L - free_tail) / trace_len, 1, max_stretch)``: the
   first revealed chunk starts at ``floor(start * s)``, each later one at the previous
   revealed chunk's end plus ``min(floor(gap * s), max_spacing)``; chunks running past the
   hint area are truncated, chunks starting past it dropped.

Each of the G hinted rollouts of a group gets its own ``eta ~ U[eta_low, eta_high]``; the G
values are sorted ascending (official code), so the group spans weak to strong hints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class HintConfig:
    """How IGPO reveals reference-trace chunks (official run: chunks 5..10, eta U[0.2, 0.6], stretch 1.5, 30 free)."""

    min_chunk: int = 5
    """smallest chunk size (tokens)"""
    max_chunk: int = 10
    """largest chunk size (tokens)"""
    eta_low: float = 0.2
    """lower bound of the revealed fraction eta"""
    eta_high: float = 0.6
    """upper bound of the revealed fraction eta"""
    max_stretch: float = 1.5
    """largest position stretch factor s"""
    free_tail: int = 30
    """last completion positions never hinted (30 at L = 256; scale down for tiny canvases)"""
    max_spacing: int = 100
    """cap on the stretched gap between revealed chunks"""
    trace_free_tail: int = 0
    """last reference-trace tokens never revealed (ours; 0 = the official rule only)"""

    def __post_init__(self) -> None:
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {self.min_chunk}, {self.max_chunk}")
        if not 0.0 <= self.eta_low <= self.eta_high <= 1.0:
            raise ValueError(f"need 0 <= eta_low <= eta_high <= 1, got {self.eta_low}, {self.eta_high}")
        if self.max_stretch < 1.0:
            raise ValueError(f"max_stretch must be >= 1, got {self.max_stretch}")
        if self.free_tail < 0 or self.max_spacing < 0 or self.trace_free_tail < 0:
            raise ValueError(
                f"free_tail, max_spacing and trace_free_tail must be >= 0, got {self.free_tail}, "
                f"{self.max_spacing}, {self.trace_free_tail}"
            )


def sample_hint_ratios(group_size: int, config: HintConfig, generator: torch.Generator | None = None) -> Tensor:
    """``(G,)`` revealed fractions eta_i ~ U[eta_low, eta_high], sorted ascending."""
    eta = config.eta_low + (config.eta_high - config.eta_low) * torch.rand(group_size, generator=generator, dtype=torch.float64)
    return torch.sort(eta).values


def chunk_trace(trace_len: int, config: HintConfig, generator: torch.Generator | None = None) -> list[tuple[int, int]]:
    """Cut ``[0, trace_len)`` into ``(start, end)`` chunks of U{min_chunk..max_chunk} tokens.

    The last chunk is cut at ``trace_len``; if that leaves it shorter than ``min_chunk`` it is dropped.
    """
    chunks, start = [], 0
    while start < trace_len:
        size = int(torch.randint(config.min_chunk, config.max_chunk + 1, (1,), generator=generator))
        end = min(start + size, trace_len)
        if end - start < config.min_chunk:
            break
        chunks.append((start, end))
        start = end
    return chunks


def build_hint(
    trace_ids: list[int], gen_length: int, eta: float, config: HintConfig, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Hint tokens and their positions in a completion of ``gen_length``.

    Args:
        trace_ids: reference trace token ids (no special tokens).
        gen_length: completion length L.
        eta: fraction of chunks to reveal.

    Returns:
        ``(hint_tokens, hint_mask)``, both ``(L,)``; tokens are only meaningful where the mask is True.
    """
    area = gen_length - config.free_tail
    tokens = torch.zeros(gen_length, dtype=torch.long)
    mask = torch.zeros(gen_length, dtype=torch.bool)
    if area <= 0 or not trace_ids:
        return tokens, mask
    placed_len = min(len(trace_ids), area)  # positions (and the stretch) refer to the whole trace
    trace = list(trace_ids[: min(placed_len, len(trace_ids) - config.trace_free_tail)])
    chunks = chunk_trace(len(trace), config, generator)
    if not chunks:
        return tokens, mask
    num_hidden = math.floor(len(chunks) * (1.0 - eta))
    hidden = set(torch.randperm(len(chunks), generator=generator)[:num_hidden].tolist())
    revealed = [chunk for i, chunk in enumerate(chunks) if i not in hidden]
    stretch = min(max(area / placed_len, 1.0), config.max_stretch)
    previous_end_orig = previous_end_new = None
    for start, end in revealed:
        if previous_end_new is None:
            new_start = math.floor(start * stretch)
        else:
            gap = start - previous_end_orig
            new_start = previous_end_new + min(math.floor(gap * stretch), config.max_spacing)
        if new_start >= area:
            break
        new_end = min(new_start + (end - start), area)
        tokens[new_start:new_end] = torch.tensor(trace[start : start + (new_end - new_start)], dtype=torch.long)
        mask[new_start:new_end] = True
        previous_end_orig, previous_end_new = end, new_end
    return tokens, mask


def build_group_hints(
    trace_ids: list[int], group_size: int, gen_length: int, config: HintConfig, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Hints for the G hinted rollouts of one group.

    Returns:
        ``(hint_tokens (G, L), hint_mask (G, L), eta (G,))`` with eta sorted ascending.
    """
    eta = sample_hint_ratios(group_size, config, generator)
    pairs = [build_hint(trace_ids, gen_length, float(e), config, generator) for e in eta]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]), eta
