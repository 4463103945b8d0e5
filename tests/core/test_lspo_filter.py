"""LSPO length-band filter (arXiv 2510.01459): hand-computed quantiles and bands."""

import pytest
import torch

from mmpo.core import lspo_filter

# 5 prompts x 2 samples; mean lengths L = 3, 10, 6, 22, 8
LENGTHS = torch.tensor([2, 4, 10, 10, 5, 7, 20, 24, 8, 8])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])


def test_bands_hand_computed():
    # sorted L = [3, 6, 8, 10, 22] (torch.quantile, linear, position q * 4):
    # Q(0.3) = 6 + 0.2 * 2 = 6.4; Q(0.65) = 8 + 0.6 * 2 = 9.2; Q(0.95) = 10 + 0.8 * 12 = 19.6
    # keep L <= 6.4 (g0 = 3, g2 = 6) or 9.2 <= L <= 19.6 (g1 = 10); g4 = 8 (middle) and g3 = 22 (> Q(0.95)) go
    result = lspo_filter(LENGTHS, GROUPS)
    assert result.keep_mask.tolist() == [True, True, True, True, True, True, False, False, False, False]
    assert result.num_dropped == 2
    # lspo_max 1.0: Q(1) = 22, so the longest prompt stays
    no_cap = lspo_filter(LENGTHS, GROUPS, max_quantile=1.0)
    assert no_cap.kept_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert no_cap.num_dropped == 1


def test_candidates_from_zero_variance_filter():
    # g1 already dropped: pool L = [3, 6, 8, 22] (position q * 3):
    # Q(0.3) = 3 + 0.9 * 3 = 5.7; Q(0.65) = 6 + 0.95 * 2 = 7.9; Q(0.95) = 8 + 0.85 * 14 = 19.9
    # keep g0 (3 <= 5.7) and g4 (7.9 <= 8 <= 19.9); g2 = 6 and g3 = 22 go; g1 is not counted again
    candidates = GROUPS != 1
    result = lspo_filter(LENGTHS, GROUPS, candidates)
    assert result.keep_mask.tolist() == [True, True, False, False, False, False, False, False, True, True]
    assert result.num_dropped == 2
    # no candidates: nothing kept, nothing newly dropped
    empty = lspo_filter(LENGTHS, GROUPS, torch.zeros(10, dtype=torch.bool))
    assert not empty.keep_mask.any() and empty.num_dropped == 0


def test_shuffle_permutes_and_errors():
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    shuffled = lspo_filter(LENGTHS[perm], GROUPS[perm] * 3 + 7)
    assert torch.equal(shuffled.keep_mask, lspo_filter(LENGTHS, GROUPS).keep_mask[perm])
    with pytest.raises(ValueError, match="low <= high"):
        lspo_filter(LENGTHS, GROUPS, low=0.7, high=0.5)
    with pytest.raises(ValueError, match="candidates must be"):
        lspo_filter(LENGTHS, GROUPS, torch.ones(3, dtype=torch.bool))
