"""Masked reductions over padded (batch, time) tensors."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Args:
        values: any shape.
        mask: same shape as ``values``; bool or 0/1 floats.
        dim: reduce this dimension only; ``None`` reduces all.
    """
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 where nothing is masked in).

    Args:
        values: any shape, e.g. ``(batch, time)``.
        mask: same shape as ``values``.
        dim: reduce this dimension only; ``None`` reduces all.
    """
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    # An empty selection gives 0 rather than NaN: padding-only rows must not poison a batch.
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked-in entries of ``values`` (scalar).

    Args:
        values: any shape.
        mask: same shape as ``values``.
        unbiased: Bessel correction (divide by n - 1), as verl's ``masked_var``.
    """
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    denom = (count - 1.0) if unbiased else count
    if bool(denom <= 0):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} masked-in entries, got {int(count.item())}"
        )
    return sq / denom


def masked_whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise the masked-in entries to zero mean and unit variance.

    ``(x - mean) * rsqrt(var + eps)`` as in verl's ``masked_whiten``; with
    ``shift_mean=False`` the mean is added back (only the scale changes).
    Masked-out positions are returned as 0.

    Args:
        values: any shape, e.g. ``(batch, time)``.
        mask: same shape as ``values``.
    """
    mask_f = mask.to(values.dtype)
    mean = masked_mean(values, mask_f)
    var = masked_var(values, mask_f, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask_f
