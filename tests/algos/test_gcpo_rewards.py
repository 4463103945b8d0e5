"""GCPO rewards and group contrastive mask (GeometryZero, arXiv 2506.07160), hand-computed."""

from __future__ import annotations

import pytest
import torch

from mmpo.core.advantages import compute_advantages
from mmpo.rewards.gcpo import (
    detect_auxiliary_keywords,
    detect_auxiliary_tag,
    gcpo_total_reward,
    get_aux_detector,
    group_contrastive_mask,
    gcpo_length_reward,
    uses_auxiliary,
)


def test_tag_detector():
    assert detect_auxiliary_tag("<think><auxiliary>draw CD parallel to AB</auxiliary> so x</think>")
    assert not detect_auxiliary_tag("<auxiliary>  </auxiliary>")  # empty block does not count
    assert not detect_auxiliary_tag("<think>no construction</think>")
    assert uses_auxiliary(["<auxiliary>x</auxiliary>", "y"]).tolist() == [True, False]


def test_pluggable_detectors():
    assert get_aux_detector("tag") is detect_auxiliary_tag
    assert detect_auxiliary_keywords("We draw a line through C parallel to AB")
    assert get_aux_detector("mmpo.rewards.gcpo:detect_auxiliary_keywords") is detect_auxiliary_keywords
    with pytest.raises(ValueError, match="unknown auxiliary detector"):
        get_aux_detector("nope")


def test_length_reward_hand_computed():
    # 0.5 * min(T, 900) / 900: 0 -> 0, 450 -> 0.25, 900 -> 0.5, 2000 -> 0.5 (capped)
    assert gcpo_length_reward(torch.tensor([0, 450, 900, 2000])).tolist() == pytest.approx([0.0, 0.25, 0.5, 0.5])
    assert gcpo_length_reward(torch.tensor([50]), cap=100, scale=1.0).tolist() == pytest.approx([0.5])


# Five groups of 4, ids interleaved with a permutation to show nothing depends on position.
GROUPS = {
    # aux  [1,1,0,0], acc [1,1,0,1]: acc_aux = 1, acc_no = 0.5 -> gap +0.5 > 0.05 -> M = +1
    10: ([1, 1, 0, 0], [1, 1, 0, 1]),
    # aux  [1,0,0,0], acc [0,1,1,0]: acc_aux = 0, acc_no = 2/3 -> gap -0.667 -> M = -1
    11: ([1, 0, 0, 0], [0, 1, 1, 0]),
    # aux  [1,1,0,0], acc [1,0,1,0]: 0.5 vs 0.5 -> |gap| <= eps -> M = 0
    12: ([1, 1, 0, 0], [1, 0, 1, 0]),
    # nobody uses aux: one side empty -> M = 0
    13: ([0, 0, 0, 0], [1, 0, 0, 0]),
    # everybody uses aux: one side empty -> M = 0
    14: ([1, 1, 1, 1], [1, 1, 1, 0]),
}
EXPECTED_MASK = {10: 1.0, 11: -1.0, 12: 0.0, 13: 0.0, 14: 0.0}


def _flat(order):
    ids, aux, acc = [], [], []
    for gid, (a, c) in GROUPS.items():
        for k in range(4):
            ids.append(gid)
            aux.append(bool(a[k]))
            acc.append(float(c[k]))
    ids, aux, acc = torch.tensor(ids), torch.tensor(aux), torch.tensor(acc)
    return ids[order], aux[order], acc[order]


def test_group_contrastive_mask_rules_and_metrics():
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    ids, aux, acc = _flat(order)
    mask, metrics = group_contrastive_mask(acc, aux, ids, eps=0.05)
    assert mask.tolist() == [EXPECTED_MASK[int(g)] for g in ids]
    assert metrics["gcpo/mask_pos_frac"] == pytest.approx(1 / 5)
    assert metrics["gcpo/mask_neg_frac"] == pytest.approx(1 / 5)
    assert metrics["gcpo/mask_zero_frac"] == pytest.approx(3 / 5)
    assert metrics["gcpo/one_side_empty_frac"] == pytest.approx(2 / 5)
    # aux rollouts: 2 + 1 + 2 + 0 + 4 = 9 of 20
    assert metrics["gcpo/aux_rollout_frac"] == pytest.approx(9 / 20)


def test_mask_eps_is_a_strict_margin():
    ids, aux, acc = _flat(torch.arange(20))
    mask, _ = group_contrastive_mask(acc, aux, ids, eps=0.5)
    # group 10's gap is exactly 0.5, not > 0.5 -> 0; group 11's |gap| 0.667 > 0.5 -> -1
    assert mask[:4].tolist() == [0.0] * 4
    assert mask[4:8].tolist() == [-1.0] * 4


def test_total_reward_and_group_advantage_hand_computed():
    # group 10 (M = +1): acc [1,1,0,1], fmt 0.5 each, aux 0.5 on the first two, T = [900, 450, 0, 90]
    acc = torch.tensor([1.0, 1.0, 0.0, 1.0])
    fmt = torch.full((4,), 0.5)
    aux = torch.tensor([0.5, 0.5, 0.0, 0.0])
    length = gcpo_length_reward(torch.tensor([900, 450, 0, 90]))  # [0.5, 0.25, 0, 0.05]
    total = gcpo_total_reward(acc, fmt, aux, length, torch.ones(4))
    # [1+0.5+0.5+0.5, 1+0.5+0.5+0.25, 0+0.5+0+0, 1+0.5+0+0.05] = [2.5, 2.25, 0.5, 1.55]
    assert total.tolist() == pytest.approx([2.5, 2.25, 0.5, 1.55])
    # with M = -1 the aux rollouts lose 0.5 instead: [1.5, 1.25, 0.5, 1.55]
    assert gcpo_total_reward(acc, fmt, aux, length, -torch.ones(4)).tolist() == pytest.approx([1.5, 1.25, 0.5, 1.55])
    adv = compute_advantages("grpo", total, torch.zeros(4, dtype=torch.long))
    mean = (2.5 + 2.25 + 0.5 + 1.55) / 4  # 1.7
    std = ((0.8**2 + 0.55**2 + 1.2**2 + 0.15**2) / 3) ** 0.5  # sqrt(2.405 / 3) = 0.895358
    assert adv.tolist() == pytest.approx([(v - mean) / (std + 1e-6) for v in [2.5, 2.25, 0.5, 1.55]], rel=1e-5)
