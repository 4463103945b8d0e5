"""Gather a picklable value from every data-parallel rank (state kept identical on all ranks)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def all_gather_objects(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order; ``[value]`` without an initialised process group.

    Objects rather than tensors (``torch.distributed.all_gather_object``): the stateful variants
    (SPO's tracker, PVPO's baseline table) exchange prompt-id strings and per-rank batches of any size.
    Every rank must call it at the same point (a collective).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
