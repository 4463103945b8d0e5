"""Signal Temporal Logic (STL) formulas with exact quantitative robustness over batches of trajectories.

A formula's :meth:`Formula.robustness` maps trajectories ``(B, T, D)`` (B signals of T discrete time steps of a
D-dimensional state) to the robustness at every time step, ``(B, T)``. Time is discrete (env steps) and the
semantics are the standard space robustness of Donze & Maler (2010), computed exactly (no soft min/max):

- predicate ``mu(x) >= 0``: ``rho = mu(x_t)``; ``not``: ``-rho``; ``and``/``or``: min/max over the children;
- ``F[a,b] phi`` (eventually): ``max_{t' in [t+a, t+b]} rho(phi, t')``;
- ``G[a,b] phi`` (always): ``min_{t' in [t+a, t+b]} rho(phi, t')``;
- ``phi U[a,b] psi`` (until): ``max_{t' in [t+a, t+b]} min(rho(psi, t'), min_{t'' in [t, t']} rho(phi, t''))``
  (phi must hold on the closed interval up to and including t', as stlcg and Donze & Maler define it).

Bounded signals: a time beyond the trajectory's end contributes nothing, so a window that lies wholly past the
end gives ``F`` and ``U`` robustness ``-inf`` (cannot be satisfied) and ``G`` robustness ``+inf`` (vacuous), and a
window that is cut short uses the time steps that exist. Check :meth:`Formula.horizon` against the trajectory
length (``T >= horizon + 1``) to evaluate the formula at ``t = 0`` on full windows only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


class Formula(ABC):
    """An STL formula; subclasses define :meth:`robustness` and :meth:`horizon`."""

    @abstractmethod
    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        """Robustness at every time step: trajectories (B, T, D) -> (B, T)."""

    @abstractmethod
    def horizon(self) -> int:
        """Time steps after t that the value at t reads (a trajectory of horizon + 1 steps is enough at t = 0)."""

    def __call__(self, traj: torch.Tensor) -> torch.Tensor:
        """Robustness at t = 0: (B, T, D) -> (B,)."""
        return self.robustness(_check_traj(traj))[:, 0]

    def __and__(self, other: "Formula") -> "And":
        return And((self, other))

    def __or__(self, other: "Formula") -> "Or":
        return Or((self, other))

    def __invert__(self) -> "Not":
        return Not(self)


def _check_traj(traj: torch.Tensor) -> torch.Tensor:
    if traj.dim() != 3:
        raise ValueError(f"STL trajectories are (batch, time, state_dim), got shape {tuple(traj.shape)}")
    return traj


def _check_interval(a: int, b: int) -> tuple[int, int]:
    if int(a) != a or int(b) != b or not 0 <= a <= b:
        raise ValueError(f"STL time intervals are integer steps with 0 <= a <= b, got [{a}, {b}]")
    return int(a), int(b)


def _windows(signal: torch.Tensor, a: int, b: int, fill: float) -> torch.Tensor:
    """(B, T) -> (B, T, b - a + 1): entry [t, k] = signal[t + a + k], ``fill`` past the end."""
    pad = torch.full((signal.shape[0], b), fill, dtype=signal.dtype, device=signal.device)
    padded = torch.cat([signal, pad], dim=1)
    return padded[:, a:a + signal.shape[1] + b - a].unfold(1, b - a + 1, 1)


@dataclass(frozen=True)
class Predicate(Formula):
    """``fn(x) >= 0`` for a function ``fn``: states (..., D) -> (...); its value is the robustness."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    name: str = "mu"

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return self.fn(traj)

    def horizon(self) -> int:
        return 0


@dataclass(frozen=True)
class Linear(Formula):
    """``w . x[dims] >= c``: robustness ``w . x[dims] - c``."""

    weights: tuple[float, ...] = ()
    dims: tuple[int, ...] = ()
    offset: float = 0.0

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.dims) or not self.dims:
            raise ValueError(f"Linear needs one weight per dim, got weights {self.weights} and dims {self.dims}")

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        w = torch.tensor(self.weights, dtype=traj.dtype, device=traj.device)
        return traj[..., list(self.dims)] @ w - self.offset

    def horizon(self) -> int:
        return 0


@dataclass(frozen=True)
class InBall(Formula):
    """``||x[dims] - center|| <= radius``: robustness ``radius - ||x[dims] - center||`` (Euclidean)."""

    center: tuple[float, ...] = ()
    radius: float = 0.0
    dims: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        if len(self.center) != len(self.dims) or self.radius <= 0:
            raise ValueError(f"InBall needs a center per dim and radius > 0, got {self.center}, {self.radius}")

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        c = torch.tensor(self.center, dtype=traj.dtype, device=traj.device)
        return self.radius - torch.linalg.vector_norm(traj[..., list(self.dims)] - c, dim=-1)

    def horizon(self) -> int:
        return 0


@dataclass(frozen=True)
class Not(Formula):
    child: Formula

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return -self.child.robustness(traj)

    def horizon(self) -> int:
        return self.child.horizon()


@dataclass(frozen=True)
class And(Formula):
    children: tuple[Formula, ...]

    def __post_init__(self) -> None:
        if not self.children:
            raise ValueError("And needs at least one child")

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return torch.stack([c.robustness(traj) for c in self.children]).amin(0)

    def horizon(self) -> int:
        return max(c.horizon() for c in self.children)


@dataclass(frozen=True)
class Or(Formula):
    children: tuple[Formula, ...]

    def __post_init__(self) -> None:
        if not self.children:
            raise ValueError("Or needs at least one child")

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return torch.stack([c.robustness(traj) for c in self.children]).amax(0)

    def horizon(self) -> int:
        return max(c.horizon() for c in self.children)


@dataclass(frozen=True)
class Eventually(Formula):
    """``F[a,b] child``."""

    child: Formula
    a: int = 0
    b: int = 0

    def __post_init__(self) -> None:
        _check_interval(self.a, self.b)

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return _windows(self.child.robustness(traj), self.a, self.b, float("-inf")).amax(-1)

    def horizon(self) -> int:
        return self.b + self.child.horizon()


@dataclass(frozen=True)
class Always(Formula):
    """``G[a,b] child``."""

    child: Formula
    a: int = 0
    b: int = 0

    def __post_init__(self) -> None:
        _check_interval(self.a, self.b)

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        return _windows(self.child.robustness(traj), self.a, self.b, float("inf")).amin(-1)

    def horizon(self) -> int:
        return self.b + self.child.horizon()


@dataclass(frozen=True)
class Until(Formula):
    """``left U[a,b] right``: right holds at some t' in [t+a, t+b] and left holds on all of [t, t']."""

    left: Formula
    right: Formula
    a: int = 0
    b: int = 0

    def __post_init__(self) -> None:
        _check_interval(self.a, self.b)

    def robustness(self, traj: torch.Tensor) -> torch.Tensor:
        left, right = self.left.robustness(traj), self.right.robustness(traj)
        steps = left.shape[1]
        # hold[:, k][t] = min_{j <= k} left(t + j) (running min, +inf past the end: it never limits the value);
        # right(t + k) is -inf past the end, so such a t' never counts
        left_w = _windows(left, 0, self.b, float("inf"))
        right_w = _windows(right, 0, self.b, float("-inf"))
        hold = torch.cummin(left_w, dim=-1).values
        terms = torch.minimum(right_w, hold)[..., self.a:self.b + 1]
        return terms.amax(-1)[:, :steps]

    def horizon(self) -> int:
        return self.b + max(self.left.horizon(), self.right.horizon())


def conjunction(parts: Sequence[Formula]) -> Formula:
    """``And`` of ``parts`` (the part itself when there is one)."""
    parts = tuple(parts)
    return parts[0] if len(parts) == 1 else And(parts)


def is_temporal(formula: Formula) -> bool:
    """Whether ``formula`` contains a temporal operator (F, G, U)."""
    if isinstance(formula, (Eventually, Always, Until)):
        return True
    if isinstance(formula, Not):
        return is_temporal(formula.child)
    if isinstance(formula, (And, Or)):
        return any(is_temporal(c) for c in formula.children)
    return False
