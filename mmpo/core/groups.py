"""Per-group statistics keyed by group id (prompt id), never by batch position.

The official MAPO code attaches group weights by position and breaks when the batch is
reordered (docs/algorithm_sources.md section 3); everything here goes through ``torch.unique`` on the ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupIndex:
    """Mapping of N samples onto their groups.

    Attributes:
        ids: ``(num_groups,)`` the distinct group ids, sorted ascending.
        inverse: ``(N,)`` position of each sample's group in ``ids``.
        counts: ``(num_groups,)`` group sizes.
    """

    ids: Tensor
    inverse: Tensor
    counts: Tensor

    @property
    def num_groups(self) -> int:
        return int(self.ids.numel())

    def sum(self, values: Tensor) -> Tensor:
        """``(N,)`` -> ``(num_groups,)`` per-group sums."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.inverse, values)

    def mean(self, values: Tensor) -> Tensor:
        """``(N,)`` -> ``(num_groups,)`` per-group means."""
        return self.sum(values) / self.counts.to(values.dtype)

    def std(self, values: Tensor, unbiased: bool = True) -> Tensor:
        """``(N,)`` -> ``(num_groups,)`` per-group standard deviations (Bessel if ``unbiased``)."""
        mean = self.mean(values)
        sq = self.sum((values - mean[self.inverse]) ** 2)
        n = self.counts.to(values.dtype)
        return torch.sqrt(sq / ((n - 1.0) if unbiased else n))

    def amax(self, values: Tensor) -> Tensor:
        out = torch.full((self.num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, self.inverse, values, reduce="amax", include_self=True)

    def amin(self, values: Tensor) -> Tensor:
        out = torch.full((self.num_groups,), torch.inf, dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, self.inverse, values, reduce="amin", include_self=True)

    def is_constant(self, values: Tensor) -> Tensor:
        """``(num_groups,)`` bool: every sample of the group has exactly the same value."""
        return self.amax(values) == self.amin(values)


def build_group_index(group_ids: Tensor, *, num_samples: int | None = None, min_size: int = 2) -> GroupIndex:
    """Index samples by group id and check group sizes.

    Args:
        group_ids: ``(N,)`` integer group (prompt) ids, in any order; groups may differ in size.
        num_samples: expected N (checked against ``group_ids``) when given.
        min_size: smallest allowed group; a smaller group raises ValueError naming it.
    """
    if group_ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D (N,), got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if num_samples is not None and group_ids.numel() != num_samples:
        raise ValueError(f"group_ids has {group_ids.numel()} entries but there are {num_samples} samples")
    if group_ids.numel() == 0:
        raise ValueError("empty batch: group_ids has no entries")
    ids, inverse, counts = torch.unique(group_ids, sorted=True, return_inverse=True, return_counts=True)
    too_small = counts < min_size
    if bool(too_small.any()):
        bad = ids[too_small].tolist()[:10]
        raise ValueError(
            f"group(s) {bad} have fewer than {min_size} samples (sizes "
            f"{counts[too_small].tolist()[:10]}): group-relative statistics need at least {min_size} "
            "rollouts per prompt; check the rollout count G and the group ids"
        )
    return GroupIndex(ids=ids, inverse=inverse, counts=counts)
