"""Group-relative advantages: hand-computed values, loop references, keying by group id."""

import math

import pytest
import torch

from mmpo.core import compute_advantages, compute_advantages_with_metrics

# Three groups of different sizes, interleaved on purpose (ids, not positions, define groups).
REWARDS = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 3, 7, 7, 3, 9, 9])
# group 7: [1, 0, 1]   group 3: [0.5, 0]   group 9: [1, 1] (all correct)


def test_grpo_hand_values():
    adv = compute_advantages("grpo", REWARDS, GROUPS, eps=0.0)
    # group 7: mean 2/3, unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3, std = 0.577350
    #   A(1) = (1/3) / 0.577350 = 0.577350 ; A(0) = (-2/3) / 0.577350 = -1.154701
    # group 3: mean 0.25, var (0.25^2 + 0.25^2) / 1 = 0.125, std 0.353553: A = +-0.707107
    # group 9: constant -> 0 / (0 + eps); with eps 0 that is 0/0, so check it separately below
    expected = [0.577350, 0.707107, -1.154701, 0.577350, -0.707107]
    assert torch.allclose(adv[:5], torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    adv_eps = compute_advantages("grpo", REWARDS, GROUPS)  # default eps 1e-6
    assert adv_eps[5:].tolist() == [0.0, 0.0]
    # eps is added to the std: 1/3 / (0.577350 + 1e-6)
    assert adv_eps[0].item() == pytest.approx((1 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-12)


def test_grpo_population_std_setting():
    adv = compute_advantages("grpo", REWARDS, GROUPS, eps=0.0, unbiased_std=False)
    # group 7 population var = (1/9 + 4/9 + 1/9) / 3 = 2/9, std 0.471405: A(1) = (1/3)/0.471405 = 0.707107
    assert adv[0].item() == pytest.approx(0.707107, abs=1e-6)
    # group 3 population std 0.25: A = +-1
    assert adv[1].item() == pytest.approx(1.0, abs=1e-12)


def test_drgrpo_and_rloo_hand_values():
    dr = compute_advantages("drgrpo", REWARDS, GROUPS)
    # r - mean: group 7 -> 1/3, -2/3, 1/3 ; group 3 -> 0.25, -0.25 ; group 9 -> 0, 0
    assert torch.allclose(dr, torch.tensor([1 / 3, 0.25, -2 / 3, 1 / 3, -0.25, 0, 0], dtype=torch.float64))
    rloo = compute_advantages("rloo", REWARDS, GROUPS)
    # r - mean(others): group 7: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1 ; group 3: 0.5 - 0 = 0.5, 0 - 0.5 = -0.5
    assert torch.allclose(rloo, torch.tensor([0.5, 0.5, -1.0, 0.5, -0.5, 0, 0], dtype=torch.float64))


def test_mapo_hand_values_and_metrics():
    adv, metrics = compute_advantages_with_metrics("mapo", REWARDS, GROUPS)
    eps = 1e-6
    # group 7: p = 2/3, lambda = 1 - 4 (2/3)(1/3) = 1/9
    #   A_std(1) = (1/3)/(0.577350 + eps), A_apd(1) = (1/3)/(2/3 + eps) = 0.5
    #   A(1) = (8/9) A_std + (1/9) A_apd = 0.513200 + 0.055556 = 0.568756 (0.568755 with eps)
    std7 = math.sqrt(1 / 3)
    a1 = (8 / 9) * (1 / 3) / (std7 + eps) + (1 / 9) * (1 / 3) / (2 / 3 + eps)
    a0 = (8 / 9) * (-2 / 3) / (std7 + eps) + (1 / 9) * (-2 / 3) / (2 / 3 + eps)
    assert a1 == pytest.approx(0.568755, abs=1e-6)
    # group 3: no reward equals 1.0 -> p = 0, lambda = 1: pure APD (r - 0.25)/(0.25 + eps) = +-1
    # group 9: all correct -> p = 1, lambda = 1, r - mu = 0 -> 0
    expected = torch.tensor([a1, 0.25 / (0.25 + eps), a0, a1, -0.25 / (0.25 + eps), 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(adv, expected, atol=1e-12)
    assert metrics["advantages/mapo_fallback_groups"] == 0.0
    # lambdas: 1/9, 1, 1 -> mean 19/27
    assert metrics["advantages/mapo_lambda_mean"] == pytest.approx(19 / 27)
    assert metrics["rewards/frac_zero_std"] == pytest.approx(1 / 3)
    assert metrics["advantages/num_groups"] == 3.0


def test_mapo_p_half_is_pure_std_and_all_zero_is_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 1])
    adv, metrics = compute_advantages_with_metrics("mapo", rewards, groups)
    # group 0: p = 1/2, lambda = 0 -> std form: mean 0.5, std sqrt(0.5) = 0.707107 -> +-0.707106
    assert adv[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-12)
    assert adv[1].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-12)
    # group 1: all zero -> 0, and it is not counted as a fallback (nothing to fall back from)
    assert adv[2:].tolist() == [0.0, 0.0, 0.0]
    assert metrics["advantages/mapo_fallback_groups"] == 0.0


def test_mapo_non_positive_mean_falls_back_to_std_and_is_counted():
    rewards = torch.tensor([-1.0, 0.5, 1.0, 0.0, -0.2, -0.4], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    for name in ("mapo", "mapo_apd", "mapo_random_lambda"):
        adv, metrics = compute_advantages_with_metrics(name, rewards, groups)
        # group 0: mean -0.25 <= 0 -> std form: centred +-0.75, std sqrt(2 * 0.75^2) = 1.060660 -> -+0.707106
        assert adv[0].item() == pytest.approx(-0.75 / (math.sqrt(2 * 0.75**2) + 1e-6), rel=1e-12)
        # group 2: mean -0.3 -> std form: centred +-0.1, std 0.141421 -> +-0.707102
        assert adv[4].item() == pytest.approx(0.1 / (math.sqrt(2 * 0.1**2) + 1e-6), rel=1e-12)
        assert metrics["advantages/mapo_fallback_groups"] == 2.0, name
        assert torch.isfinite(adv).all()


def test_mapo_apd_hand_values():
    adv = compute_advantages("mapo_apd", REWARDS, GROUPS)
    eps = 1e-6
    # (r - mu)/(mu + eps): group 7 mu 2/3 -> 0.5, -1, 0.5; group 3 mu 0.25 -> 1, -1; group 9 -> 0
    expected = [(1 / 3) / (2 / 3 + eps), 0.25 / (0.25 + eps), (-2 / 3) / (2 / 3 + eps), (1 / 3) / (2 / 3 + eps),
                -0.25 / (0.25 + eps), 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_mapo_random_lambda_is_seeded_and_matches_formula():
    eps = 1e-6
    adv1 = compute_advantages("mapo_random_lambda", REWARDS, GROUPS, generator=torch.Generator().manual_seed(5))
    adv2 = compute_advantages("mapo_random_lambda", REWARDS, GROUPS, generator=torch.Generator().manual_seed(5))
    adv3 = compute_advantages("mapo_random_lambda", REWARDS, GROUPS, generator=torch.Generator().manual_seed(6))
    assert torch.equal(adv1, adv2) and not torch.equal(adv1, adv3)
    # one U[0,1] draw per group, in ascending id order: ids 3, 7, 9
    lam3, lam7, _lam9 = torch.rand(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64).tolist()
    a_std7, a_apd7 = (1 / 3) / (math.sqrt(1 / 3) + eps), (1 / 3) / (2 / 3 + eps)
    assert adv1[0].item() == pytest.approx((1 - lam7) * a_std7 + lam7 * a_apd7, rel=1e-12)
    a_std3, a_apd3 = 0.25 / (math.sqrt(0.125) + eps), 0.25 / (0.25 + eps)
    assert adv1[1].item() == pytest.approx((1 - lam3) * a_std3 + lam3 * a_apd3, rel=1e-12)
    assert adv1[5:].tolist() == [0.0, 0.0]


def _loop_reference(name, rewards, groups, eps=1e-6):
    """Plain per-group python loop (the obvious implementation) for comparison."""
    out = torch.zeros_like(rewards)
    for gid in groups.unique().tolist():
        idx = (groups == gid).nonzero().flatten().tolist()
        r = [rewards[i].item() for i in idx]
        n = len(r)
        mu = sum(r) / n
        sd = math.sqrt(sum((x - mu) ** 2 for x in r) / (n - 1))
        for i, x in zip(idx, r):
            if name == "grpo":
                out[i] = (x - mu) / (sd + eps)
            elif name == "drgrpo":
                out[i] = x - mu
            elif name == "rloo":
                out[i] = x - (sum(r) - x) / (n - 1)
            elif name == "mapo":
                p = sum(1 for y in r if y == 1.0) / n
                lam = 1 - 4 * p * (1 - p)
                if mu <= 0:
                    out[i] = (x - mu) / (sd + eps)
                else:
                    out[i] = (1 - lam) * (x - mu) / (sd + eps) + lam * (x - mu) / (mu + eps)
    return out


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "mapo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_matches_loop_reference_on_random_groups(name, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 7, (6,), generator=gen).tolist()
    groups = torch.cat([torch.full((s,), 100 + 3 * g) for g, s in enumerate(sizes)])
    groups = groups[torch.randperm(groups.numel(), generator=gen)]
    rewards = torch.randint(0, 3, (groups.numel(),), generator=gen).to(torch.float64) / 2  # {0, 0.5, 1}
    adv = compute_advantages(name, rewards, groups)
    assert torch.allclose(adv, _loop_reference(name, rewards, groups), atol=1e-10)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "mapo", "mapo_apd", "mapo_random_lambda"])
def test_shuffling_the_batch_permutes_the_output(name):
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 5, 5])
    rewards = torch.randint(0, 2, (11,), generator=gen).to(torch.float32)
    rewards[9:] = torch.tensor([0.3, 1.0])
    perm = torch.randperm(11, generator=gen)
    settings = lambda: {"generator": torch.Generator().manual_seed(3)} if name == "mapo_random_lambda" else {}  # noqa: E731
    adv = compute_advantages(name, rewards, groups, **settings())
    adv_shuffled = compute_advantages(name, rewards[perm], groups[perm], **settings())
    assert torch.allclose(adv_shuffled, adv[perm], atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "mapo", "opo", "gpg", "grpo_passk"])
def test_group_of_one_is_a_one_line_error_naming_the_estimator_and_the_minimum(name):
    settings = {"mask": torch.ones(3, 2)} if name == "opo" else {}
    with pytest.raises(ValueError) as caught:
        compute_advantages(name, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1, 1, 4]), **settings)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"advantage estimator {name!r} needs at least 2 samples per group; group(s) [4] have [1]")


def test_min_group_size_of_each_estimator():
    from mmpo.core import min_group_size

    assert [min_group_size(n) for n in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")] == [1, 1, 1]
    assert [min_group_size(n) for n in ("grpo", "rloo", "opo", "grpo_passk")] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        min_group_size("no_such_estimator")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="3 entries but there are 2 samples"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"non-finite at positions \[1\]"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages("grpo", torch.ones(2, 2), torch.tensor([0, 0]))


def test_integer_rewards_are_promoted_to_float():
    adv = compute_advantages("drgrpo", torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.get_default_dtype() and adv.tolist() == [0.5, -0.5]


def test_finite_rewards_whose_group_statistics_overflow_are_an_error_not_nan_advantages():
    # 3e38 + 3e38 overflows float32 to inf: the group mean would be inf and r - mean -inf / NaN
    rewards = torch.tensor([3e38, 3e38, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"advantage estimator 'grpo': rewards up to \|r\| = 3e\+38 overflow the "
                                         r"group statistics in torch.float32"):
        compute_advantages("grpo", rewards, torch.tensor([0, 0, 1, 1]))
    # in float64 the same rewards are fine: group 0 agrees (A = 0), group 1 is +-1/sqrt(0.5) / (1/sqrt(2) + eps)
    adv = compute_advantages("grpo", rewards.double(), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2:].tolist() == pytest.approx([-0.5 / (0.5 ** 0.5 + 1e-6), 0.5 / (0.5 ** 0.5 + 1e-6)], rel=1e-12)
    # 2e19 is the smallest kind of trouble: its square (4e38) is inf in float32 while its sum is not
    with pytest.raises(ValueError, match="overflow the group statistics"):
        compute_advantages("rloo", torch.tensor([2e19, 0.0]), torch.tensor([0, 0]))
