"""Dynamic sampling, GFPO filtering, DAPO overlong punishment, ReDit dithering."""

import pytest
import torch

from mmpo.core import (
    compute_advantages,
    dither_rewards,
    dynamic_sampling_filter,
    gfpo_filter,
    overlong_soft_punishment,
)


def test_dynamic_sampling_hand_example_and_shuffle():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 3])
    # group 0 = [1, 1] and group 2 = [0, 0] agree -> dropped; groups 1 and 3 kept
    result = dynamic_sampling_filter(rewards, groups)
    assert result.kept_indices.tolist() == [2, 3, 6, 7, 8, 9]
    assert result.num_dropped == 2
    assert result.keep_mask.tolist() == [False, False, True, True, False, False, True, True, True, True]
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    shuffled = dynamic_sampling_filter(rewards[perm], groups[perm])
    assert torch.equal(shuffled.keep_mask, result.keep_mask[perm])
    with pytest.raises(ValueError, match="fewer than 2"):
        dynamic_sampling_filter(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_gfpo_shortest_and_reward_per_length():
    # group 5: lengths 10, 5, 7, 3 ; rewards 1, 0, 1, 1
    # group 2: lengths 4, 4, 9      ; rewards 0, 1, 1   (a tie in length)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([10, 5, 4, 7, 4, 3, 9])
    groups = torch.tensor([5, 5, 2, 5, 2, 5, 2])
    shortest = gfpo_filter(rewards, lengths, groups, k=2, metric="length")
    # group 5: shortest two are length 3 (pos 5) and 5 (pos 1); group 2: lengths 4, 4 (pos 2, 4)
    assert shortest.kept_indices.tolist() == [1, 2, 4, 5]
    assert shortest.num_dropped == 3
    efficient = gfpo_filter(rewards, lengths, groups, k=2, metric="reward_per_length")
    # group 5 reward/length: 0.1, 0, 1/7 = 0.143, 1/3 -> keep pos 5 and 3
    # group 2: 0/4 = 0, 1/4 = 0.25, 1/9 = 0.111 -> keep pos 4 and 6
    assert efficient.kept_indices.tolist() == [3, 4, 5, 6]
    # GFPO advantages: subset statistics over the kept samples only
    kept = efficient.kept_indices
    adv = compute_advantages("grpo", rewards[kept], groups[kept])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]  # each kept pair has equal rewards


def test_gfpo_tie_keeps_earlier_position_and_errors():
    result = gfpo_filter(torch.zeros(4), torch.tensor([5, 5, 5, 5]), torch.tensor([0, 0, 0, 0]), k=2)
    assert result.kept_indices.tolist() == [0, 1]
    with pytest.raises(ValueError, match="fewer than 3 samples"):
        gfpo_filter(torch.zeros(4), torch.ones(4), torch.tensor([0, 0, 1, 1]), k=3)
    with pytest.raises(ValueError, match="k must be >= 2"):
        gfpo_filter(torch.zeros(4), torch.ones(4), torch.tensor([0, 0, 1, 1]), k=1)
    with pytest.raises(ValueError, match="unknown GFPO metric"):
        gfpo_filter(torch.zeros(4), torch.ones(4), torch.tensor([0, 0, 1, 1]), k=2, metric="reward")
    with pytest.raises(ValueError, match="lengths must be positive"):
        gfpo_filter(torch.zeros(2), torch.tensor([0, 1]), torch.tensor([0, 0]), k=2)


def test_overlong_soft_punishment_hand_values():
    lengths = torch.tensor([1000, 16384, 16385, 18432, 20480, 20481])
    penalty = overlong_soft_punishment(lengths, max_length=20480, cache_length=4096)
    # L_max - L_cache = 16384: <= 16384 -> 0 ; 16385 -> -1/4096 ; 18432 -> -2048/4096 = -0.5
    # 20480 -> -4096/4096 = -1 ; > 20480 -> -1
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -1 / 4096, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_length"):
        overlong_soft_punishment(lengths, max_length=10, cache_length=20)


@pytest.mark.parametrize("distribution", ["uniform", "gaussian"])
def test_dither_is_seeded_zero_mean_and_breaks_ties(distribution):
    rewards = torch.ones(20000, dtype=torch.float64)
    a = dither_rewards(rewards, scale=0.05, distribution=distribution, generator=torch.Generator().manual_seed(0))
    b = dither_rewards(rewards, scale=0.05, distribution=distribution, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    noise = a - rewards
    # zero mean: |mean| well inside 4 standard errors (std <= 0.05)
    assert abs(noise.mean().item()) < 4 * 0.05 / (20000**0.5)
    if distribution == "uniform":
        assert noise.abs().max().item() <= 0.05
        assert noise.std().item() == pytest.approx(0.05 / 3**0.5, rel=0.05)  # U(-a, a) std a/sqrt(3)
    else:
        assert noise.std().item() == pytest.approx(0.05, rel=0.05)
    # an all-correct group gets non-zero GRPO advantages after dithering
    groups = torch.zeros(4, dtype=torch.long)
    dithered = dither_rewards(torch.ones(4), distribution=distribution, generator=torch.Generator().manual_seed(1))
    assert compute_advantages("grpo", dithered, groups).abs().min() > 0


def test_dither_errors_and_integer_rewards():
    out = dither_rewards(torch.tensor([0, 1]), scale=0.0)
    assert out.tolist() == [0.0, 1.0] and out.dtype == torch.get_default_dtype()
    with pytest.raises(ValueError, match="unknown dither distribution"):
        dither_rewards(torch.ones(2), distribution="laplace")
    with pytest.raises(ValueError, match="scale must be >= 0"):
        dither_rewards(torch.ones(2), scale=-1.0)
