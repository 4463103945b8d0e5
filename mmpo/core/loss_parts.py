"""Named loss terms summed in one place (the TorchRL objective pattern).

An update builds its loss as named parts, each a 0-d tensor with a coefficient:

    parts = LossParts()
    parts.add("policy", pg_loss)
    parts.add("kl", kl, coef=beta)
    parts.add("entropy", entropy, coef=-entropy_coef)
    loss = parts.total()            # sum of coef * term
    logged = parts.metrics()        # {"losses/policy": ..., "losses/kl": ..., "losses/entropy": ...}

``parts[name]`` and ``losses/<name>`` are the unweighted terms; only :meth:`LossParts.total`
applies the coefficients, so no caller re-adds or re-weights a term.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import Tensor


class LossParts(Mapping[str, Tensor]):
    """An ordered mapping name -> unweighted 0-d loss term, each with a coefficient."""

    def __init__(self) -> None:
        self._terms: dict[str, tuple[Tensor, float]] = {}

    def add(self, name: str, value: Tensor | float, coef: float = 1.0) -> LossParts:
        """Add term ``name`` (a duplicate name raises ValueError); returns ``self`` for chaining."""
        if name in self._terms:
            raise ValueError(f"duplicate loss part {name!r}; parts so far: {list(self._terms)}")
        value = value if isinstance(value, Tensor) else torch.as_tensor(float(value))
        if value.ndim != 0:
            raise ValueError(f"loss part {name!r} must be a 0-d tensor, got shape {tuple(value.shape)}")
        self._terms[name] = (value, float(coef))
        return self

    def update_from(self, other: LossParts) -> LossParts:
        """Add every part of ``other`` (names must not clash); returns ``self``."""
        for name in other:
            self.add(name, other[name], other.coefficient(name))
        return self

    def coefficient(self, name: str) -> float:
        return self._terms[name][1]

    def weighted(self, name: str) -> Tensor:
        """coef * term of part ``name``."""
        value, coef = self._terms[name]
        return value if coef == 1.0 else coef * value

    def total(self) -> Tensor:
        """Sum of coef * term in insertion order. Parts with coefficient 0 are left out, so a
        switched-off term (e.g. entropy_coef 0) can neither change nor poison (NaN) the loss;
        when every part is switched off the total is 0. No parts at all raise ValueError."""
        if not self._terms:
            raise ValueError("no loss parts to sum")
        active = [name for name, (_, coef) in self._terms.items() if coef != 0.0]
        if not active:
            return torch.zeros_like(next(iter(self._terms.values()))[0])
        total = self.weighted(active[0])
        for name in active[1:]:
            total = total + self.weighted(name)
        return total

    def metrics(self, prefix: str = "losses/") -> dict[str, Tensor]:
        """``{prefix + name: detached unweighted term}``."""
        return {f"{prefix}{name}": value.detach() for name, (value, _) in self._terms.items()}

    def __getitem__(self, name: str) -> Tensor:
        return self._terms[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._terms)

    def __len__(self) -> int:
        return len(self._terms)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={float(v.detach()):.6g}*{c:g}" for n, (v, c) in self._terms.items())
        return f"LossParts({inner})"


def as_loss_parts(value: LossParts | Mapping[str, Tensor | float] | Tensor | float, name: str = "extra") -> LossParts:
    """A hook's loss contribution as parts: LossParts as is, a mapping as unit-coefficient parts,
    a single tensor or number as the one part ``name``."""
    if isinstance(value, LossParts):
        return value
    parts = LossParts()
    if isinstance(value, Mapping):
        for key, term in value.items():
            parts.add(key, term)
        return parts
    return parts.add(name, value)
