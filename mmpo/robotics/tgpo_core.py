"""TGPO's decomposition of an STL task and its time allocations (Meng & Fan, "TGPO: Temporal Grounded Policy
Optimization for Signal Temporal Logic Tasks", 2025; the official mengyuest/TGPO repository holds only a README,
so everything here is transcribed from the paper; docs/tgpo.md lists the choices the paper leaves open).

- :func:`decompose`: an STL formula made of ``and``, ``F[a,b]`` (eventually) and ``G[a,b]`` (always), with nesting
  ``F[a,b](reach and F[c,d](...) and G[e,f](...))``, becomes *reach subgoals* (subgoal k: its non-temporal reach
  formula must hold at one time tau_k inside its interval, taken relative to its parent subgoal's time) and
  *invariants* (a non-temporal formula that must hold on a window, relative to its parent's time).
- a *time allocation* tau (K integer env steps, one per subgoal) is feasible when every tau_k lies in
  ``[lo_k + tau_parent, hi_k + tau_parent]`` (tau_parent = 0 at the top level). If every reach formula holds at its
  tau_k and every invariant on its window, the formula is satisfied (each F is witnessed by tau_k, each G by its
  window), so the allocation turns the STL task into timed reach-avoid stages.
- :func:`stage_reward`: the dense stage-wise reward of the time-conditioned policy.
- :func:`mh_acceptance`, :func:`mh_step`: Metropolis-Hastings over allocations driven by the critic V(s0, tau),
  accept with ``min(1, exp((V(tau') - V(tau)) / T))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mmpo.robotics.stl import And, Always, Eventually, Formula, conjunction, is_temporal


@dataclass(frozen=True)
class Subgoal:
    """Reach ``reach`` at one time in ``[lo, hi]`` after the parent subgoal's time (after 0 when parent is None)."""

    reach: Formula
    lo: int
    hi: int
    parent: int | None = None


@dataclass(frozen=True)
class Invariant:
    """``formula`` must hold on every step of ``[lo, hi]`` after the parent subgoal's time (after 0 when None)."""

    formula: Formula
    lo: int
    hi: int
    parent: int | None = None


@dataclass(frozen=True)
class Decomposition:
    """Subgoals (a parent always comes before its children) and invariants of one STL task."""

    subgoals: tuple[Subgoal, ...]
    invariants: tuple[Invariant, ...]

    @property
    def num_subgoals(self) -> int:
        return len(self.subgoals)

    def bounds(self, k: int, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute (lo, hi) of subgoal k given the allocations ``tau`` (N, K) of its ancestors: (N,), (N,)."""
        goal = self.subgoals[k]
        base = tau[:, goal.parent] if goal.parent is not None else torch.zeros(tau.shape[0], dtype=tau.dtype)
        return base + goal.lo, base + goal.hi

    def project(self, tau: torch.Tensor) -> torch.Tensor:
        """The nearest feasible allocation, subgoal by subgoal (parents first): tau_k clamped to its bounds."""
        out = tau.clone()
        for k in range(self.num_subgoals):
            lo, hi = self.bounds(k, out)
            out[:, k] = torch.minimum(torch.maximum(out[:, k], lo), hi)
        return out

    def feasible(self, tau: torch.Tensor) -> torch.Tensor:
        """(N,) bool: every tau_k inside its bounds."""
        ok = torch.ones(tau.shape[0], dtype=torch.bool)
        for k in range(self.num_subgoals):
            lo, hi = self.bounds(k, tau)
            ok &= (tau[:, k] >= lo) & (tau[:, k] <= hi)
        return ok

    def uniform(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` allocations drawn uniformly, subgoal by subgoal (integer steps in each bounds): (n, K) long."""
        tau = torch.zeros(n, self.num_subgoals, dtype=torch.long)
        for k in range(self.num_subgoals):
            lo, hi = self.bounds(k, tau)
            u = torch.rand(n, generator=generator, dtype=torch.float64)
            tau[:, k] = lo + torch.floor(u * (hi - lo + 1).double()).long().clamp_max(hi - lo)
        return tau

    def midpoints(self, n: int = 1) -> torch.Tensor:
        """The allocation at the middle of every interval: (n, K) long."""
        tau = torch.zeros(n, self.num_subgoals, dtype=torch.long)
        for k in range(self.num_subgoals):
            lo, hi = self.bounds(k, tau)
            tau[:, k] = (lo + hi) // 2
        return tau

    def invariant_windows(self, tau: torch.Tensor) -> list[tuple[Formula, torch.Tensor, torch.Tensor]]:
        """(formula, absolute lo (N,), absolute hi (N,)) of every invariant under allocations ``tau`` (N, K)."""
        out = []
        for inv in self.invariants:
            base = tau[:, inv.parent] if inv.parent is not None else torch.zeros(tau.shape[0], dtype=tau.dtype)
            out.append((inv.formula, base + inv.lo, base + inv.hi))
        return out

    def horizon(self) -> int:
        """The latest step any subgoal or invariant can reach under a feasible allocation."""
        latest: list[int] = []
        for goal in self.subgoals:
            latest.append(goal.hi + (latest[goal.parent] if goal.parent is not None else 0))
        ends = [inv.hi + (latest[inv.parent] if inv.parent is not None else 0) for inv in self.invariants]
        return max(latest + ends)


def decompose(formula: Formula) -> Decomposition:
    """Reach subgoals and invariants of ``formula`` (see the module docstring for the supported form).

    ``F[a,b](phi)`` is a subgoal whose reach formula is the conjunction of phi's non-temporal parts; phi's
    temporal parts (F and G) nest under it. ``G[a,b](psi)`` with a non-temporal psi is an invariant. A top-level
    ``and`` lists independent parts. Anything else (or, not of a temporal formula, until, F of F) raises
    ``ValueError`` naming the part."""
    subgoals: list[Subgoal] = []
    invariants: list[Invariant] = []

    def walk(node: Formula, parent: int | None) -> None:
        if isinstance(node, And):
            for child in node.children:
                walk(child, parent)
        elif isinstance(node, Eventually):
            parts = node.child.children if isinstance(node.child, And) else (node.child,)
            reach = [p for p in parts if not is_temporal(p)]
            if not reach:
                raise ValueError(f"TGPO decomposition: {node} has no reach formula (F of a temporal formula only)")
            index = len(subgoals)
            subgoals.append(Subgoal(conjunction(reach), node.a, node.b, parent))
            for part in parts:
                if is_temporal(part):
                    walk(part, index)
        elif isinstance(node, Always) and not is_temporal(node.child):
            invariants.append(Invariant(node.child, node.a, node.b, parent))
        else:
            raise ValueError(f"TGPO decomposition supports and / F[a,b] / G[a,b] (non-temporal inside G) nesting; "
                             f"cannot decompose {type(node).__name__}: {node}")

    walk(formula, None)
    if not subgoals:
        raise ValueError("TGPO decomposition: the formula has no reach subgoal (no F[a,b])")
    return Decomposition(tuple(subgoals), tuple(invariants))


def _state_robustness(formula: Formula, state: torch.Tensor) -> torch.Tensor:
    """Robustness of a non-temporal formula at states (N, D): (N,)."""
    return formula.robustness(state.unsqueeze(1))[:, 0]


def current_subgoal(tau: torch.Tensor, t: int) -> torch.Tensor:
    """(N,) index of the subgoal being pursued at step t: the pending one (tau_k >= t) due first (the lowest
    index among ties); -1 once every subgoal is due."""
    pending = torch.where(tau >= t, tau, torch.full_like(tau, torch.iinfo(tau.dtype).max))
    index = pending.argmin(dim=1)
    return torch.where((tau >= t).any(dim=1), index, torch.full_like(index, -1))


def stage_count(tau: torch.Tensor, t: int) -> torch.Tensor:
    """(N,) number of subgoals already due before step t (#{k: tau_k < t}): the policy's stage."""
    return (tau < t).sum(dim=1)


def stage_reward(decomposition: Decomposition, prev_state: torch.Tensor, state: torch.Tensor, t: int,
                 tau: torch.Tensor, *, bonus: float = 1.0, invariant_weight: float = 1.0) -> torch.Tensor:
    """Dense stage-wise reward of the step that reached ``state`` (N, D) at time t >= 1 from ``prev_state``.

    ``reward = [rho_k(s_t) - rho_k(s_{t-1})]`` (progress toward the subgoal k being pursued, the pending one due
    first) ``+ sum_{k: tau_k = t} (bonus * 1[rho_k(s_t) > 0] + min(rho_k(s_t), 0))`` (each subgoal judged at its
    allocated time) ``- invariant_weight * sum_{invariants active at t} max(-rho_inv(s_t), 0)``.
    The paper names the terms (stage progress, subgoal reached at its time, invariant violation); their exact
    form and weights are this implementation's choice (docs/tgpo.md)."""
    n = state.shape[0]
    reward = torch.zeros(n, dtype=state.dtype)
    goal = current_subgoal(tau, t)
    for k, sub in enumerate(decomposition.subgoals):
        now = _state_robustness(sub.reach, state)
        progress = now - _state_robustness(sub.reach, prev_state)
        reward = reward + torch.where(goal == k, progress, torch.zeros_like(progress))
        due = tau[:, k] == t
        judged = bonus * (now > 0).to(state.dtype) + now.clamp_max(0.0)
        reward = reward + torch.where(due, judged, torch.zeros_like(judged))
    for formula, lo, hi in decomposition.invariant_windows(tau):
        violation = (-_state_robustness(formula, state)).clamp_min(0.0)
        active = (lo <= t) & (t <= hi)
        reward = reward - invariant_weight * torch.where(active, violation, torch.zeros_like(violation))
    return reward


def mh_acceptance(v_new: torch.Tensor, v_old: torch.Tensor, temperature: float) -> torch.Tensor:
    """Metropolis-Hastings acceptance probability ``min(1, exp((V(tau') - V(tau)) / T))``."""
    if temperature <= 0:
        raise ValueError(f"MH temperature must be > 0, got {temperature}")
    return torch.exp(((v_new - v_old) / temperature).clamp_max(0.0))


def mh_step(tau: torch.Tensor, value_fn: Callable[[torch.Tensor], torch.Tensor], decomposition: Decomposition, *,
            temperature: float, proposal_std: float, generator: torch.Generator | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One MH step for every chain: propose tau' = project(round(tau + proposal_std * eps)), accept with
    :func:`mh_acceptance` of the critic's values. Returns (the chains' new allocations (N, K), accepted (N,))."""
    noise = torch.randn(tau.shape, generator=generator, dtype=torch.float64)
    proposal = decomposition.project(torch.round(tau.double() + proposal_std * noise).long())
    prob = mh_acceptance(value_fn(proposal), value_fn(tau), temperature)
    u = torch.rand(tau.shape[0], generator=generator, dtype=torch.float64)
    accepted = u < prob.double()
    return torch.where(accepted.unsqueeze(1), proposal, tau), accepted


def best_by_value(candidates: Sequence[torch.Tensor], value_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per row, the candidate allocation (each (N, K)) with the highest critic value: (N, K)."""
    stacked = torch.stack(list(candidates))  # (M, N, K)
    values = torch.stack([value_fn(c) for c in candidates])  # (M, N)
    best = values.argmax(dim=0)
    return stacked[best, torch.arange(stacked.shape[1])]
