"""STL robustness (mmpo/robotics/stl.py): every operator against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.robotics.stl import Always, And, Eventually, InBall, Linear, Not, Or, Predicate, Until, is_temporal

INF = math.inf
# one 1-D signal x_t, t = 0..4
X = torch.tensor([[[1.0], [-2.0], [3.0], [0.0], [-1.0]]])
P = Linear(weights=(1.0,), dims=(0,), offset=0.0)  # x >= 0: rho = x
Q = Linear(weights=(1.0,), dims=(0,), offset=1.0)  # x >= 1: rho = x - 1 = [0, -3, 2, -1, -2]


def values(formula, traj=X):
    return formula.robustness(traj)[0].tolist()


def test_predicates_and_boolean_operators():
    assert values(P) == [1, -2, 3, 0, -1]
    assert values(Q) == [0, -3, 2, -1, -2]
    assert values(Not(P)) == [-1, 2, -3, 0, 1]
    assert values(And((P, Q))) == [0, -3, 2, -1, -2]
    assert values(P | Not(Q)) == [1, 3, 3, 1, 2]  # max(x, 1 - x)
    assert values(Or((Q, Not(P)))) == [0, 2, 2, 0, 1]
    double = Linear(weights=(2.0, -1.0), dims=(1, 0), offset=0.5)  # 2 y - x >= 0.5
    assert Predicate(lambda s: s[..., 0] * 3, "3x")(X).tolist() == [3.0]
    assert double(torch.tensor([[[1.0, 2.0]]])).tolist() == [2.0 * 2 - 1 - 0.5]


def test_ball_robustness():
    ball = InBall((0.0, 0.0), 1.0)
    traj = torch.tensor([[[0.6, 0.8], [3.0, 4.0], [0.0, 0.0]]])
    assert values(ball, traj) == pytest.approx([0.0, -4.0, 1.0])
    with pytest.raises(ValueError, match="radius"):
        InBall((0.0, 0.0), 0.0)


def test_eventually_and_always_windows():
    # F[1,2] x: max(x_{t+1}, x_{t+2}); the window is cut at the end, empty windows give -inf
    assert values(Eventually(P, 1, 2)) == [3, 3, 0, -1, -INF]
    # G[1,2] x: min over the same windows, +inf when empty
    assert values(Always(P, 1, 2)) == [-2, 0, -1, -1, INF]
    assert values(Eventually(P, 0, 0)) == values(P)
    assert values(Always(P, 0, 4))[0] == -2
    with pytest.raises(ValueError, match="0 <= a <= b"):
        Eventually(P, 3, 1)


def test_until_by_hand():
    # x U[1,3] (x >= 1): max over t' in [t+1, t+3] of min(q(t'), min_{t''in[t,t']} p(t''))
    # t=0: t'=1 min(-3, -2) = -3; t'=2 min(2, -2) = -2; t'=3 min(-1, -2) = -2 -> -2
    # t=1: t'=2 min(2, -2); t'=3 min(-1, -2); t'=4 min(-2, -2) -> -2
    # t=2: t'=3 min(-1, min(3, 0) = 0) = -1; t'=4 min(-2, -1) = -2 -> -1
    # t=3: t'=4 min(-2, min(0, -1)) = -2; t=4: no t' -> -inf
    assert values(Until(P, Q, 1, 3)) == [-2, -2, -1, -2, -INF]
    # a satisfied until: left = [2, 1, 0.5], right = [-1, 0.3, 5]
    left = Linear(weights=(1.0,), dims=(0,))
    right = Linear(weights=(1.0,), dims=(1,))
    traj = torch.tensor([[[2.0, -1.0], [1.0, 0.3], [0.5, 5.0]]])
    # t=0: t'=0 min(-1, 2) = -1; t'=1 min(0.3, 1) = 0.3; t'=2 min(5, 0.5) = 0.5 -> 0.5
    assert Until(left, right, 0, 2)(traj).item() == pytest.approx(0.5)
    # left must hold at t' itself (closed interval): left = [2, -4] blocks t'=1 even though right(1) = 3
    blocked = torch.tensor([[[2.0, -1.0], [-4.0, 3.0]]])
    assert Until(left, right, 0, 1)(blocked).item() == pytest.approx(-1.0)
    # U[0,b] with an always-true left is F[0,b] right
    true = Linear(weights=(0.0,), dims=(0,), offset=-100.0)
    assert values(Until(true, Q, 0, 2)) == values(Eventually(Q, 0, 2))


def test_nested_intervals():
    # G[1,2] x = [-2, 0, -1, -1, inf]; F[0,2] of it at t=0: max(-2, 0, -1) = 0
    nested = Eventually(Always(P, 1, 2), 0, 2)
    assert nested.horizon() == 4 and nested(X).item() == 0
    # F[0,1] x = [1, 3, 3, 0, -1]; G[0,3] of it at t=0: min(1, 3, 3, 0) = 0
    assert Always(Eventually(P, 0, 1), 0, 3)(X).item() == 0
    # F[0,1](x >= 1 and F[1,2] x): inner F = [3, 3, 0, -1, -inf], and with q = [0, -3, 0, -1, -2];
    # outer at t=0: max(0, -3) = 0
    seq = Eventually(And((Q, Eventually(P, 1, 2))), 0, 1)
    assert seq(X).item() == 0 and seq.horizon() == 3
    assert is_temporal(seq) and not is_temporal(And((P, Not(Q))))


def test_batched_rows_equal_single_rows():
    torch.manual_seed(0)
    traj = torch.randn(5, 9, 2)
    formula = And((Eventually(InBall((0.5, 0.0), 0.4), 0, 4), Always(Not(InBall((0.0, 0.0), 0.2)), 0, 8),
                   Until(Linear(weights=(1.0,), dims=(1,), offset=-1.0), InBall((0.0, 0.5), 0.5), 1, 6)))
    batched = formula.robustness(traj)
    for row in range(5):
        assert torch.equal(batched[row], formula.robustness(traj[row:row + 1])[0])
    with pytest.raises(ValueError, match="batch, time, state_dim"):
        formula(traj[0])
