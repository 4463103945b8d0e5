"""TreePO and Segment-PO estimators (mmpo.core.advantages_tree): hand-worked values."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from mmpo.core import compute_advantages, compute_advantages_with_metrics
from mmpo.core.advantages_tree import segment_cut_points, segment_probability_mask

D = torch.float64
NAN = float("nan")

# one prompt, a binary tree of depth 2: leaves [0,0], [0,1], [1,0], [1,1], one token each
PATHS = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)
ONE_PROMPT = torch.zeros(4, dtype=torch.long)
ONE_TOKEN = torch.ones(4, 1, dtype=D)


def _whiten(values: list[float]) -> list[float]:
    """(x - mean) / sqrt(sample var + 1e-8), written out with the statistics module."""
    mean, var = statistics.mean(values), statistics.variance(values)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_treepo_average_over_depths_then_whitened():
    # depth 0: mean 0.75 -> [0.25, -0.75, 0.25, 0.25]
    # depth 1: {0,1} mean 0.5 -> [0.5, -0.5]; {2,3} mean 1 -> [0, 0]
    # average: [0.375, -0.625, 0.125, 0.125]; mean 0, sample var 0.5625 / 3 = 0.1875
    adv, metrics = compute_advantages_with_metrics("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS)
    expected = torch.tensor([0.375, -0.625, 0.125, 0.125], dtype=D) / math.sqrt(0.1875 + 1e-8)
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.8660254, -1.4433757, 0.2886751, 0.2886751], dtype=D),
                               atol=1e-6, rtol=0)
    assert metrics["advantages/tree_levels_mean"] == 2.0


def test_treepo_group_size_weighting():
    # weights 4 (root) and 2 (subtree): leaf0 (4*0.25 + 2*0.5)/6 = 1/3, leaf1 (4*-0.75 + 2*-0.5)/6 = -2/3,
    # leaves 2, 3: (4*0.25 + 0)/6 = 1/6; mean 0, sample var (1/9 + 4/9 + 1/36 + 1/36)/3 = 22/108
    adv = compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS, weighting="group_size")
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 6, 1 / 6], dtype=D) / math.sqrt(22 / 108 + 1e-8)
    torch.testing.assert_close(adv[:, 0], expected)


def test_treepo_zero_std_subgroups_skipped_on_request():
    # subtree {2,3} has rewards [1, 1] (std 0): leaves 2, 3 keep only the root term 0.25
    # scores [0.375, -0.625, 0.25, 0.25]
    adv = compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS,
                             skip_zero_std_subgroups=True)
    torch.testing.assert_close(adv[:, 0], torch.tensor(_whiten([0.375, -0.625, 0.25, 0.25]), dtype=D))


def test_treepo_early_stopped_leaf_and_token_weighted_whitening():
    # leaves [0,0], [0,1], [1,-1] (leaf 2 stopped at depth 1), rewards [1, 0, 0], lengths [2, 1, 1]
    # depth 0: mean 1/3 -> [2/3, -1/3, -1/3]; depth 1: {0,1} mean 0.5 -> [0.5, -0.5]; {2} singleton: skipped
    # scores: (2/3 + 1/2)/2 = 7/12, (-1/3 - 1/2)/2 = -5/12, -1/3; whitened over the 4 tokens
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=D)
    adv, metrics = compute_advantages_with_metrics(
        "treepo", torch.tensor([1.0, 0.0, 0.0], dtype=D), torch.zeros(3, dtype=torch.long), mask=mask,
        path_ids=torch.tensor([[0, 0], [0, 1], [1, -1]]))
    w = _whiten([7 / 12, 7 / 12, -5 / 12, -4 / 12])
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0]], dtype=D))
    assert metrics["advantages/tree_levels_mean"] == pytest.approx(5 / 3)  # levels 2, 2, 1


def test_treepo_is_keyed_by_ids_not_positions():
    perm = torch.tensor([2, 0, 3, 1])
    adv = compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS)
    shuffled = compute_advantages("treepo", REWARDS[perm], ONE_PROMPT[perm], mask=ONE_TOKEN[perm], path_ids=PATHS[perm])
    torch.testing.assert_close(shuffled, adv[perm])


def test_treepo_rejects_bad_inputs():
    with pytest.raises(ValueError, match="weighting"):
        compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS, weighting="sum")
    with pytest.raises(ValueError, match="path_ids"):
        compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN, path_ids=PATHS[:2])
    with pytest.raises(ValueError, match="needs the input"):
        compute_advantages("treepo", REWARDS, ONE_PROMPT, mask=ONE_TOKEN)


# Segment-PO. Row 0: length 6, rollout probabilities [0.95, 0.5, 0.99, 0.3, 0.97, 0.6]: low (< 0.9) at 1, 3, 5,
# cut points 0, 2, 4. Row 1: length 3 of width 6, probabilities [0.4, 0.95, 0.8]: low at 0, 2 -> cuts -1, 1.
PROBS = torch.tensor([[0.95, 0.5, 0.99, 0.3, 0.97, 0.6], [0.4, 0.95, 0.8, 1.0, 1.0, 1.0]], dtype=D)
SEG_MASK = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=D)
# state_values[i, c + 1] = V(after token c): row 0: V(0)=0.2, V(2)=0.6, V(4)=0.4; row 1: V(prompt)=0.5, V(1)=0.25
VALUES = torch.full((2, 7), NAN, dtype=D)
VALUES[0, 1], VALUES[0, 3], VALUES[0, 5] = 0.2, 0.6, 0.4
VALUES[1, 0], VALUES[1, 2] = 0.5, 0.25
SEG_REWARDS = torch.tensor([1.0, 0.0], dtype=D)
TWO_PROMPTS = torch.tensor([0, 0])


def test_segment_cut_points_follow_the_official_rule():
    log_probs = PROBS.log()
    assert segment_cut_points(log_probs, SEG_MASK, interval=1) == [[0, 2, 4], [-1, 1]]
    assert segment_cut_points(log_probs, SEG_MASK, interval=2) == [[0, 4], [-1]]
    assert segment_cut_points(log_probs, SEG_MASK) == [[0], [-1]]  # interval 5
    with pytest.raises(ValueError, match="interval"):
        segment_cut_points(log_probs, SEG_MASK, interval=0)


def test_segment_advantages_are_value_differences_with_probability_mask():
    # row 0 walk: t0 first value, no prompt value -> 0; t2: 0.6 - 0.2 = 0.4; t4: 0.4 - 0.6 = -0.2;
    # t5 (last, value = reward 1): 1 - 0.4 = 0.6; back-fill t1 <- 0.4, t3 <- -0.2 -> [0, .4, .4, -.2, -.2, .6];
    # probability mask (p > 0.9 at t0, t2, t4) -> [0, .4, 0, -.2, 0, .6]
    # row 1: t1: 0.25 - 0.5 = -0.25; t2 (last, reward 0): 0 - 0.25 = -0.25; back-fill t0 <- -0.25;
    # mask t1 (0.95) -> [-.25, 0, -.25]
    adv, metrics = compute_advantages_with_metrics(
        "segment", SEG_REWARDS, TWO_PROMPTS, mask=SEG_MASK, old_log_probs=PROBS.log(), state_values=VALUES,
        whiten=False)
    expected = torch.tensor([[0, 0.4, 0, -0.2, 0, 0.6], [-0.25, 0, -0.25, 0, 0, 0]], dtype=D)
    torch.testing.assert_close(adv, expected)
    assert metrics["advantages/prob_masked_frac"] == pytest.approx(4 / 9)  # t0, t2, t4 of row 0, t1 of row 1
    assert metrics["advantages/segments_per_sample"] == pytest.approx(3.0)  # 4 valued tokens + 2, over 2 rows


def test_segment_whitening_skips_masked_tokens():
    adv = compute_advantages("segment", SEG_REWARDS, TWO_PROMPTS, mask=SEG_MASK, old_log_probs=PROBS.log(),
                             state_values=VALUES)
    w = _whiten([0.4, -0.2, 0.6, -0.25, -0.25])  # the kept tokens only
    expected = torch.tensor([[0, w[0], 0, w[1], 0, w[2]], [w[3], 0, w[4], 0, 0, 0]], dtype=D)
    torch.testing.assert_close(adv, expected)


def test_segment_probability_mask():
    keep = segment_probability_mask(PROBS.log(), SEG_MASK)
    assert keep.tolist() == [[0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 0, 0]]


def test_segment_rejects_bad_value_shape():
    with pytest.raises(ValueError, match="state_values"):
        compute_advantages("segment", SEG_REWARDS, TWO_PROMPTS, mask=SEG_MASK, old_log_probs=PROBS.log(),
                           state_values=VALUES[:, :6])
