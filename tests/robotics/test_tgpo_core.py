"""TGPO's decomposition, allocations, stage-wise reward and MH search (mmpo/robotics/tgpo_core.py), by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmpo.robotics.envs.stl_envs import pointmass_spec
from mmpo.robotics.stl import Always, And, Eventually, InBall, Linear, Not, Or, Until
from mmpo.robotics.tgpo_core import (
    Decomposition,
    Invariant,
    Subgoal,
    best_by_value,
    current_subgoal,
    decompose,
    mh_acceptance,
    mh_step,
    stage_count,
    stage_reward,
)

A = Linear(weights=(1.0,), dims=(0,), offset=1.0)  # x >= 1
B = Linear(weights=(-1.0,), dims=(0,), offset=1.0)  # x <= -1
C = Linear(weights=(-1.0,), dims=(0,), offset=-2.0)  # x <= 2


def test_decompose_the_nested_pointmass_spec():
    d = decompose(pointmass_spec(3))
    g1, g2, g3 = (InBall(c, 0.15) for c in [(0.6, -0.2), (0.6, 0.6), (-0.6, 0.6)])
    assert d.subgoals == (Subgoal(g1, 0, 20, None), Subgoal(g2, 5, 20, 0), Subgoal(g3, 5, 20, 1))
    assert d.invariants == (Invariant(Not(InBall((0.0, 0.1), 0.25)), 0, 60, None),)
    assert d.horizon() == 60


def test_decompose_invariants_nested_under_a_subgoal_and_conjunctive_reach():
    d = decompose(Eventually(And((A, C, Always(B, 1, 2), Eventually(B, 2, 3))), 0, 4))
    assert d.subgoals[0] == Subgoal(And((A, C)), 0, 4, None) and d.subgoals[1] == Subgoal(B, 2, 3, 0)
    assert d.invariants == (Invariant(B, 1, 2, 0),)
    (formula, lo, hi), = d.invariant_windows(torch.tensor([[3, 6]]))
    assert formula == B and (lo.item(), hi.item()) == (4, 5)  # [1, 2] after tau_0 = 3
    assert d.horizon() == 7


def test_decompose_the_tight_pointmass_spec():
    d = decompose(pointmass_spec(2, "tight"))
    g1, g2 = (InBall(c, 0.15) for c in [(0.6, -0.2), (0.6, 0.6)])
    assert d.subgoals == (Subgoal(g1, 0, 10, None), Subgoal(g2, 0, 10, 0))
    assert d.invariants == (Invariant(Not(InBall((0.0, 0.1), 0.25)), 0, 20, None),)
    assert d.horizon() == 20
    # tau_1 in [0, 10], tau_2 in [tau_1, tau_1 + 10]
    assert d.project(torch.tensor([[12, 3], [4, 15]])).tolist() == [[10, 10], [4, 14]]
    with pytest.raises(ValueError, match="windows must be one of"):
        pointmass_spec(2, "loose")


@pytest.mark.parametrize("formula", [Until(A, B, 0, 2), Or((Eventually(A, 0, 1), Eventually(B, 0, 1))),
                                     Eventually(Eventually(A, 0, 1), 0, 1), Always(Eventually(A, 0, 1), 0, 2), A,
                                     Always(A, 0, 3)])
def test_decompose_rejects_what_it_cannot_split(formula):
    with pytest.raises(ValueError, match="TGPO decomposition"):
        decompose(formula)


def test_bounds_project_feasible_uniform_midpoints():
    d = Decomposition((Subgoal(A, 0, 20, None), Subgoal(B, 5, 20, 0)), ())
    tau = torch.tensor([[25, 3], [10, 12], [4, 30], [10, 40]])
    # subgoal 1 lives in [tau_0 + 5, tau_0 + 20]
    assert d.project(tau).tolist() == [[20, 25], [10, 15], [4, 24], [10, 30]]
    assert d.feasible(tau).tolist() == [False, False, False, False]
    assert d.feasible(d.project(tau)).all()
    assert d.midpoints(2).tolist() == [[10, 22], [10, 22]]  # 10, then 10 + (5 + 20) // 2
    draws = d.uniform(4000, torch.Generator().manual_seed(0))
    assert d.feasible(draws).all()
    assert set(draws[:, 0].tolist()) == set(range(21))  # every integer step of [0, 20] is drawn
    assert abs(draws[:, 0].double().mean().item() - 10.0) < 0.3


def test_stage_count_and_current_subgoal():
    tau = torch.tensor([[2, 4], [6, 3]])
    assert stage_count(tau, 0).tolist() == [0, 0] and stage_count(tau, 4).tolist() == [1, 1]
    assert stage_count(tau, 7).tolist() == [2, 2]
    assert current_subgoal(tau, 1).tolist() == [0, 1]  # the pending subgoal due first
    assert current_subgoal(tau, 4).tolist() == [1, 0] and current_subgoal(tau, 7).tolist() == [-1, -1]


def test_stage_reward_by_hand():
    d = Decomposition((Subgoal(A, 0, 5, None), Subgoal(B, 1, 3, 0)), (Invariant(C, 0, 10, None),))
    tau = torch.tensor([[2, 4]])
    path = [0.0, 0.5, 1.2, 2.5, -0.5, -0.5]

    def reward(t):
        prev, now = torch.tensor([[path[t - 1]]]), torch.tensor([[path[t]]])
        return stage_reward(d, prev, now, t, tau, bonus=1.0, invariant_weight=2.0).item()

    # t=1: pursuing subgoal 0 (due at 2): progress (0.5 - 1) - (0 - 1) = 0.5
    assert reward(1) == pytest.approx(0.5)
    # t=2: progress 0.7; subgoal 0 due: rho = 0.2 > 0 -> bonus 1 + min(0.2, 0) = 1
    assert reward(2) == pytest.approx(1.7)
    # t=3: pursuing subgoal 1: (-2.5 - 1) - (-1.2 - 1) = -1.3; invariant 2 - 2.5 = -0.5 -> -2 x 0.5
    assert reward(3) == pytest.approx(-2.3)
    # t=4: progress (0.5 - 1) - (-3.5) = 3.0; subgoal 1 due: rho = -0.5 -> 0 + min(-0.5, 0)
    assert reward(4) == pytest.approx(2.5)
    # t=5: everything due, invariant holds: nothing
    assert reward(5) == pytest.approx(0.0)


def test_mh_acceptance_by_hand():
    v_old = torch.tensor([2.0, 2.0, 2.0, 1.0])
    v_new = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert mh_acceptance(v_new, v_old, 0.5).tolist() == pytest.approx([math.exp(-2.0), 1.0, 1.0, math.exp(-2.0)])
    assert mh_acceptance(v_new, v_old, 2.0).tolist() == pytest.approx([math.exp(-0.5), 1.0, 1.0, math.exp(-0.5)])
    with pytest.raises(ValueError, match="temperature"):
        mh_acceptance(v_new, v_old, 0.0)


def test_mh_step_accepts_exactly_where_the_uniform_draw_is_below_the_acceptance():
    d = Decomposition((Subgoal(A, 0, 20, None), Subgoal(B, 5, 20, 0)), ())
    tau = d.midpoints(64)
    value = lambda t: -0.1 * (t[:, 0] - 3).abs().double()  # noqa: E731  (prefers tau_0 near 3)
    new, accepted = mh_step(tau, value, d, temperature=0.5, proposal_std=3.0,
                            generator=torch.Generator().manual_seed(7))
    # the same draws by hand: noise first, then the uniforms
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(tau.shape, generator=g, dtype=torch.float64)
    proposal = d.project(torch.round(tau.double() + 3.0 * noise).long())
    u = torch.rand(64, generator=g, dtype=torch.float64)
    prob = torch.exp(torch.clamp((value(proposal) - value(tau)) / 0.5, max=0.0))
    assert torch.equal(accepted, u < prob)
    assert torch.equal(new, torch.where(accepted.unsqueeze(1), proposal, tau))
    assert d.feasible(new).all() and 0 < int(accepted.sum()) < 64
    # a much better proposal is always taken, a much worse never
    always = mh_step(tau, lambda t: 1e3 * (t != tau).any(1).double(), d, temperature=1.0, proposal_std=3.0,
                     generator=torch.Generator().manual_seed(1))[1]
    never = mh_step(tau, lambda t: -1e3 * (t != tau).any(1).double(), d, temperature=1.0, proposal_std=3.0,
                    generator=torch.Generator().manual_seed(1))
    assert always.all() and torch.equal(never[0], tau)


def test_mh_chain_concentrates_on_high_value():
    d = Decomposition((Subgoal(A, 0, 20, None),), ())
    tau = torch.full((500, 1), 18)
    value = lambda t: -(t[:, 0] - 4).abs().double()  # noqa: E731
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        tau, _ = mh_step(tau, value, d, temperature=0.5, proposal_std=2.0, generator=g)
    # stationary law ~ exp(-|tau - 4| / 0.5) on [0, 20]: mass at 4 is (1 - e^-2) / (1 + e^-2) ~ 0.76
    assert abs(float((tau[:, 0] == 4).double().mean()) - 0.76) < 0.08


def test_best_by_value_picks_per_row():
    c1, c2 = torch.tensor([[1, 9], [2, 8]]), torch.tensor([[3, 7], [4, 6]])
    values = {1: 0.0, 3: 1.0, 2: 5.0, 4: -1.0}
    best = best_by_value([c1, c2], lambda t: torch.tensor([values[int(x)] for x in t[:, 0]]))
    assert best.tolist() == [[3, 7], [2, 8]]
    assert np.array_equal(best.numpy(), np.array([[3, 7], [2, 8]]))
