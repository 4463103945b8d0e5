"""BRPO estimator (mmpo.core.advantages_budget): hand-worked values."""

from __future__ import annotations

import pytest
import torch

from mmpo.core import compute_advantages, compute_advantages_with_metrics
from mmpo.core.advantages_budget import (
    brpo_objective,
    brpo_segment_advantages,
    brpo_summary_advantages,
    budget_prior,
)
from mmpo.core.groups import build_group_index

D = torch.float64


def test_priors():
    torch.testing.assert_close(budget_prior("uniform", 4), torch.full((4,), 0.25, dtype=D))
    torch.testing.assert_close(budget_prior("linear", 3), torch.tensor([1 / 6, 2 / 6, 3 / 6], dtype=D))  # j / 6
    torch.testing.assert_close(budget_prior("base", 3), torch.tensor([0.0, 0.0, 1.0], dtype=D))
    torch.testing.assert_close(budget_prior([0.2, 0.8], 2), torch.tensor([0.2, 0.8], dtype=D))
    with pytest.raises(ValueError, match="unknown budget prior"):
        budget_prior("exp", 2)
    with pytest.raises(ValueError, match="summing to 1"):
        budget_prior([0.5, 0.6], 2)


def test_two_budgets_by_hand():
    # S = 2, p = [.5, .5]; r = [[0, 1], [1, 1]]
    # returns R>=0 = [.5, 1], R>=1 = [.5, .5]
    # s=0: V2 = .75 -> A = [-.25, .25]
    # s=1: V2 = .5; V1 = r_0 * p_1 = [0, .5]; baseline (V1 + V2)/2 = [.25, .5] -> A = [.25, 0]
    scores = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=D)
    index = build_group_index(torch.tensor([0, 0]))
    torch.testing.assert_close(brpo_segment_advantages(scores, index), torch.tensor([[-0.25, 0.25], [0.25, 0.0]], dtype=D))


def test_three_budgets_own_history_weights_recent_budgets_more():
    # S = 3, p = 1/3 each; g0 r = [1, 0, 1], g1 r = [0, 0, 0]
    # g0: R = [2/3, 1/3, 1/3]; g1: R = 0
    # s=0: V2 = 1/3 -> A = [1/3, -1/3]
    # s=1: V2 = 1/6; V1(g0) = (1 * 1)/1 * 2/3 = 2/3 -> baseline (2/3 + 2 * 1/6)/3 = 1/3 -> A = 0;
    #      V1(g1) = 0 -> baseline (2/6)/3 = 1/9 -> A = -1/9
    # s=2: V2 = 1/6; V1(g0) = (2^0 * 1 + 2^1 * 0)/3 * 1/3 = 1/9 -> baseline (2/9 + 1/6)/3 = 7/54 -> A = 1/3 - 7/54 = 11/54;
    #      V1(g1) = 0 -> baseline (1/6)/3 = 1/18 -> A = -1/18
    scores = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    index = build_group_index(torch.tensor([5, 5]))
    expected = torch.tensor([[1 / 3, 0.0, 11 / 54], [-1 / 3, -1 / 9, -1 / 18]], dtype=D)
    torch.testing.assert_close(brpo_segment_advantages(scores, index), expected)


def test_linear_prior_objective():
    # p = [1/6, 2/6, 3/6]: [1, 0, 1] -> 1/6 + 3/6 = 2/3
    torch.testing.assert_close(brpo_objective(torch.tensor([[1.0, 0.0, 1.0]], dtype=D), "linear"),
                               torch.tensor([2 / 3], dtype=D))


def test_summary_advantages_subtract_the_same_budget_mean():
    scores = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]], dtype=D)  # one response, S = 2, A = 2
    torch.testing.assert_close(brpo_summary_advantages(scores), torch.tensor([[[0.5, -0.5], [0.0, 0.0]]], dtype=D))


def test_registered_estimator_maps_segments_to_tokens():
    # the two-budget case above; tokens of g0: segments [0, 0, 1, -1 (summary cue, no advantage)]
    scores = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=D)
    rewards = brpo_objective(scores)  # [.5, 1]
    segment_ids = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=D)
    adv, metrics = compute_advantages_with_metrics("brpo", rewards, torch.tensor([0, 0]), mask=mask,
                                                   budget_scores=scores, segment_ids=segment_ids)
    torch.testing.assert_close(adv, torch.tensor([[-0.25, -0.25, 0.25, 0.0], [0.25, 0.0, 0.0, 0.0]], dtype=D))
    assert metrics["advantages/brpo_objective_mean"] == pytest.approx(0.75)


def test_rewards_must_be_the_objective():
    scores = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=D)
    with pytest.raises(ValueError, match="brpo_objective"):
        compute_advantages("brpo", torch.tensor([1.0, 1.0], dtype=D), torch.tensor([0, 0]), mask=torch.ones(2, 1),
                           budget_scores=scores, segment_ids=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids must lie"):
        compute_advantages("brpo", brpo_objective(scores), torch.tensor([0, 0]), mask=torch.ones(2, 1),
                           budget_scores=scores, segment_ids=torch.full((2, 1), 2))
