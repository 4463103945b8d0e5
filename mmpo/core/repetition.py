"""CAMPO's repetition critic (MiroMind-M1, arXiv 2507.14683): detect a loop at the end of a response
and penalise the reward of responses that ran out of budget inside one.

Reference: the official ``find_infinite_loop_start`` and ``compute_campo_outcome_advantage`` in
MiroMindAsia/MiroMind-M1 ``verl/trainer/ppo/core_algos.py`` (read at 3ace1ab), re-derived here:

- loop ratio: for every period ``L`` from 1 to ``n // min_repeats``, count how many copies of the last
  ``L`` tokens repeat back to back at the end; the longest period with at least ``min_repeats`` copies
  gives the loop start ``s = n - copies * L``; the ratio is ``(n - s) / n`` (0 when no period repeats);
- penalty: a response that filled the whole length budget (official: ``response_mask.all()``) with a
  loop ratio > 0 loses ``penalty`` (official 0.1, the function's default; the scripts' ``dynamic`` value
  is never read by that code) before the GRPO group statistics.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

REPETITION_MODES = ("constant", "ratio")


def loop_ratio(tokens: Sequence[int] | Tensor, *, min_repeats: int = 2) -> float:
    """Share of ``tokens`` covered by the loop it ends in (official ``find_infinite_loop_start``,
    ``distance=False``): 0.0 without one, 1.0 when the whole sequence is one repeated period."""
    if min_repeats < 2:
        raise ValueError(f"min_repeats must be >= 2, got {min_repeats}")
    seq = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    n = len(seq)
    start = n
    for period in range(1, n // min_repeats + 1):
        copies, right = 1, n - period
        while right - period >= 0 and seq[right - period : right] == seq[right : right + period]:
            copies += 1
            right -= period
        if copies >= min_repeats:  # the longest repeating period decides the start (official order)
            start = right
    return (n - start) / n if start < n else 0.0


def repetition_penalties(
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    max_length: int,
    penalty: float = 0.1,
    mode: str = "constant",
    min_repeats: int = 2,
    only_truncated: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-response penalty (to subtract from the reward) and loop ratio.

    Args:
        completion_ids: ``(N, T)`` response tokens.
        completion_mask: ``(N, T)`` 1 on real tokens (a prefix).
        max_length: the length budget; a response of this many tokens "ran out of budget".
        penalty: the penalty size (official 0.1).
        mode: ``constant`` (official code: ``penalty`` when the ratio is > 0) or ``ratio``
            (``penalty x ratio``: a loop that starts earlier costs more; the paper's adaptive reading,
            unverified against its code).
        min_repeats: copies needed to call it a loop (official 2).
        only_truncated: penalise only responses that used the whole budget (official); False = all.

    Returns:
        ``(penalties (N,), ratios (N,))``, float32; ratios are computed only where a penalty can apply.
    """
    if mode not in REPETITION_MODES:
        raise ValueError(f"unknown repetition mode {mode!r}; valid: {list(REPETITION_MODES)}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    lengths = completion_mask.sum(-1)
    ratios = torch.zeros(completion_ids.shape[0], dtype=torch.float32)
    for i in range(completion_ids.shape[0]):
        n = int(lengths[i])
        if n == 0 or (only_truncated and n < max_length):
            continue
        ratios[i] = loop_ratio(completion_ids[i, :n], min_repeats=min_repeats)
    if mode == "constant":
        return (ratios > 0).to(torch.float32) * penalty, ratios
    return ratios * penalty, ratios
