"""Loss aggregation over (batch, time): the normaliser is an explicit, honoured choice.

Modes (names follow verl's ``loss_agg_mode``; the peers' names for each mode: docs/algorithm_sources.md
section 6, aggregation):

- ``token-mean`` (DAPO, arXiv 2503.14476): sum over all real tokens / number of real tokens.
- ``seq-mean-token-mean`` (original GRPO, arXiv 2402.03300): per-sequence token mean, then the
  mean over sequences.
- ``seq-mean-token-sum``: per-sequence token sum, then the mean over sequences.
- ``seq-mean-token-sum-norm`` (Dr.GRPO, arXiv 2503.20783): total token sum / (num_seqs * L),
  L a constant (``norm_len``, default the mask width).

Under gradient accumulation or data parallelism pass the **global** counts
(``global_tokens``: real tokens over every micro-batch and rank; ``global_seqs``: sequences
with at least one real token, likewise). Then each micro-batch's value is its share of the
full-batch loss, and the sum of micro-batch losses equals the full-batch loss.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor


class AggregationMode(str, Enum):
    """Valid aggregation modes."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


AGGREGATION_MODES: tuple[str, ...] = tuple(m.value for m in AggregationMode)
#: one line per mode (``mmpo list aggregation``)
AGGREGATION_DESCRIPTIONS: dict[str, str] = {
    "token-mean": "sum over all real tokens / number of real tokens (DAPO)",
    "seq-mean-token-mean": "per-sequence token mean, then the mean over sequences (original GRPO)",
    "seq-mean-token-sum": "per-sequence token sum, then the mean over sequences",
    "seq-mean-token-sum-norm": "total token sum / (num_seqs * L), L a constant (Dr.GRPO)",
}


def _check_mode(mode: str | AggregationMode) -> str:
    value = mode.value if isinstance(mode, AggregationMode) else mode
    if value not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {list(AGGREGATION_MODES)}")
    return value


def _as_count(count: int | float | Tensor, like: Tensor, name: str) -> Tensor:
    count_t = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    if count_t.ndim != 0:
        raise ValueError(f"{name} must be a scalar count, got shape {tuple(count_t.shape)}")
    if bool(count_t <= 0):
        raise ValueError(f"{name} must be positive, got {count_t.item()}")
    return count_t


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str | AggregationMode = "token-mean",
    *,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
    norm_len: int | float | None = None,
) -> Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Args:
        values: ``(batch, time)`` per-token values (e.g. per-token losses).
        mask: ``(batch, time)`` 1 for real tokens, 0 for padding (bool or float).
        mode: one of :data:`AGGREGATION_MODES`.
        global_tokens: total real tokens over all micro-batches and ranks (``token-mean``);
            default: the real tokens of this batch.
        global_seqs: total non-empty sequences over all micro-batches and ranks (the three
            ``seq-mean-*`` modes); default: the non-empty sequences of this batch.
        norm_len: the constant L of ``seq-mean-token-sum-norm``; default ``values.shape[-1]``.

    Returns:
        0-d tensor.
    """
    mode = _check_mode(mode)
    if values.ndim != 2:
        raise ValueError(f"aggregate expects (batch, time) values, got shape {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    mask_f = mask.to(values.dtype)
    masked = values * mask_f

    if mode == AggregationMode.TOKEN_MEAN.value:
        if global_tokens is None:
            denom = mask_f.sum().clamp(min=1.0)
        else:
            denom = _as_count(global_tokens, values, "global_tokens")
        return masked.sum() / denom

    tokens_per_seq = mask_f.sum(dim=-1)
    if global_seqs is None:
        # Sequences that are pure padding are skipped (as verl does), never counted.
        num_seqs = (tokens_per_seq > 0).to(values.dtype).sum().clamp(min=1.0)
    else:
        num_seqs = _as_count(global_seqs, values, "global_seqs")

    seq_sums = masked.sum(dim=-1)
    if mode == AggregationMode.SEQ_MEAN_TOKEN_MEAN.value:
        return (seq_sums / tokens_per_seq.clamp(min=1.0)).sum() / num_seqs
    if mode == AggregationMode.SEQ_MEAN_TOKEN_SUM.value:
        return seq_sums.sum() / num_seqs
    # seq-mean-token-sum-norm (Dr.GRPO): constant length normaliser, no per-sequence length.
    length = values.shape[-1] if norm_len is None else norm_len
    if length <= 0:
        raise ValueError(f"norm_len must be positive, got {length}")
    return seq_sums.sum() / (num_seqs * float(length))
