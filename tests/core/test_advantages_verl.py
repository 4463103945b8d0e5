"""verl's advantage estimators (mmpo.core.advantages_verl): hand-worked values on tiny batches.

Parity with verl's own functions on seeded inputs is checked by bench/parity_verl_advantages.py
(verl is not a dependency); these tests pin the arithmetic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mmpo.core import ADVANTAGE_ESTIMATORS, VERL_ADVANTAGE_ESTIMATORS, compute_advantages, compute_advantages_with_metrics
from mmpo.core.advantages_verl import discounted_returns, outcome_token_rewards

D = torch.float64


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width, dtype=D)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return mask


# rewards [1, 0, 2, 0], two groups, completion lengths [2, 1, 3, 2] in width 3
REWARDS = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=D)
GROUPS = torch.tensor([0, 0, 1, 1])
MASK = _mask([2, 1, 3, 2], 3)


def test_every_verl_name_is_registered():
    assert {e.value for e in VERL_ADVANTAGE_ESTIMATORS} <= set(ADVANTAGE_ESTIMATORS.names())
    assert len(VERL_ADVANTAGE_ESTIMATORS) == 8


def test_outcome_reward_sits_on_the_last_masked_in_token():
    placed = outcome_token_rewards(REWARDS, MASK)
    assert placed.tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 2], [0, 0, 0]]
    # an empty row carries nothing
    assert outcome_token_rewards(torch.tensor([5.0], dtype=D), torch.zeros(1, 2, dtype=D)).tolist() == [[0, 0]]


def test_discounted_returns_reset_at_masked_out_positions():
    # gamma 1, rewards [1, 0, 2] all valid: G = [3, 2, 2]
    full = discounted_returns(torch.tensor([[1.0, 0.0, 2.0]], dtype=D), torch.ones(1, 3, dtype=D), 1.0)
    assert full.tolist() == [[3.0, 2.0, 2.0]]
    # hole at t=1: G_2 = 1, G_1 = 0 + 1 = 1 then reset, G_0 = 0 (verl's "reset after EOS")
    holed = discounted_returns(torch.tensor([[0.0, 0.0, 1.0]], dtype=D), torch.tensor([[1.0, 0.0, 1.0]], dtype=D), 1.0)
    assert holed.tolist() == [[0.0, 1.0, 1.0]]


def test_reinforce_plus_plus_hand_values():
    # gamma 0.5, outcome rewards on the last token: row0 G = [0.5, 1], row1 [0], row2 [0.5, 1, 2], row3 [0, 0]
    # 8 valid tokens: sum 5, mean 0.625; squared deviations sum to 3.375; Bessel var = 3.375 / 7
    adv = compute_advantages("reinforce_plus_plus", REWARDS, GROUPS, mask=MASK, gamma=0.5)
    returns = torch.tensor([[0.5, 1, 0], [0, 0, 0], [0.5, 1, 2], [0, 0, 0]], dtype=D)
    expected = (returns - 0.625) / math.sqrt(3.375 / 7 + 1e-8) * MASK
    assert adv.shape == (4, 3)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)


def test_reinforce_plus_plus_token_rewards_and_their_consistency_check():
    token = torch.tensor([[0.5, 0.5, 9.0], [0, 0, 0], [1, 0, 1], [0, 0, 0]], dtype=D)  # 9.0 is padding
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=D)
    adv = compute_advantages("reinforce_plus_plus", rewards, GROUPS, mask=MASK, token_rewards=token)
    # gamma 1: G = row0 [1, 0.5], row1 [0], row2 [2, 1, 1], row3 [0, 0]; sum 5.5 over 8, mean 0.6875
    valid = torch.tensor([1, 0.5, 0, 2, 1, 1, 0, 0], dtype=D)
    var = float(((valid - 0.6875) ** 2).sum()) / 7
    assert adv[2].tolist() == pytest.approx([(v - 0.6875) / math.sqrt(var + 1e-8) for v in (2, 1, 1)], rel=1e-12)
    with pytest.raises(ValueError, match="masked per-row sum"):
        compute_advantages("reinforce_plus_plus", rewards + 1, GROUPS, mask=MASK, token_rewards=token)


def test_reinforce_plus_plus_baseline_hand_values():
    # group means 0.5 and 1.0: centred [0.5, -0.5, 1.0, -1.0]; per token: 0.5 x2, -0.5 x1, 1.0 x3, -1.0 x2
    # mean = (1 - 0.5 + 3 - 2) / 8 = 0.1875; Bessel var over the 8 tokens
    adv = compute_advantages("reinforce_plus_plus_baseline", REWARDS, GROUPS, mask=MASK)
    tokens = torch.tensor([0.5, 0.5, -0.5, 1, 1, 1, -1, -1], dtype=D)
    var = float(((tokens - 0.1875) ** 2).sum()) / 7
    scale = 1 / math.sqrt(var + 1e-8)
    assert adv[0].tolist() == pytest.approx([(0.5 - 0.1875) * scale] * 2 + [0.0], rel=1e-12)
    assert adv[3].tolist() == pytest.approx([(-1 - 0.1875) * scale] * 2 + [0.0], rel=1e-12)


def test_reinforce_plus_plus_baseline_singleton_groups_have_mean_zero():
    # groups {0: [1, 0]}, {1: [2]}, {2: [3]}: centred [0.5, -0.5, 2, 3] (a singleton's mean is 0, as verl's)
    # per token: 0.5 x2, -0.5 x1, 2 x3, 3 x2; sum 12.5 over 8 tokens, mean 1.5625
    # squared deviations: 2 x 1.12890625 + 4.25390625 + 3 x 0.19140625 + 2 x 2.06640625 = 11.21875; var 11.21875 / 7
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=D)
    adv = compute_advantages("reinforce_plus_plus_baseline", rewards, torch.tensor([0, 0, 1, 2]), mask=MASK)
    scale = 1 / math.sqrt(11.21875 / 7 + 1e-8)
    expected = [[(0.5 - 1.5625) * scale] * 2 + [0.0], [(-0.5 - 1.5625) * scale, 0.0, 0.0],
                [(2 - 1.5625) * scale] * 3, [(3 - 1.5625) * scale] * 2 + [0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=D), rtol=1e-12, atol=1e-12)


def _verl_baseline_loop(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` written as its per-sample loop:
    a singleton group's mean is 0, the rest their mean; then masked whitening (mean over tokens, Bessel var)."""
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards.tolist(), group_ids.tolist()):
        by_group.setdefault(g, []).append(r)
    means = {g: 0.0 if len(v) == 1 else sum(v) / len(v) for g, v in by_group.items()}
    scores = torch.tensor([r - means[g] for r, g in zip(rewards.tolist(), group_ids.tolist())], dtype=D)
    tokens = scores.unsqueeze(-1) * mask
    valid = tokens[mask > 0]
    mean, var = valid.mean(), valid.var(unbiased=True)
    return (tokens - mean) * torch.rsqrt(var + 1e-8) * mask


def test_reinforce_plus_plus_at_one_sample_per_prompt_and_mixed_group_sizes_match_verls_loop():
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 3, 1, 2, 4, 1]  # mixed: singletons beside groups of 2-4, interleaved below
    group_ids = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    perm = torch.randperm(group_ids.numel(), generator=gen)
    group_ids = group_ids[perm]
    rewards = torch.rand(group_ids.numel(), generator=gen, dtype=D) * 2 - 0.5
    mask = _mask(torch.randint(1, 6, (group_ids.numel(),), generator=gen).tolist(), 5)
    ours = compute_advantages("reinforce_plus_plus_baseline", rewards, group_ids, mask=mask)
    torch.testing.assert_close(ours, _verl_baseline_loop(rewards, group_ids, mask), rtol=1e-10, atol=1e-12)
    # n = 1 everywhere: the baseline variant whitens the raw rewards; REINFORCE++ ignores groups entirely
    singles = torch.arange(rewards.numel())
    torch.testing.assert_close(compute_advantages("reinforce_plus_plus_baseline", rewards, singles, mask=mask),
                               _verl_baseline_loop(rewards, singles, mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(compute_advantages("reinforce_plus_plus", rewards, singles, mask=mask),
                               compute_advantages("reinforce_plus_plus", rewards, group_ids, mask=mask))
    # ReMax needs no group either
    baselines = torch.zeros_like(rewards)
    assert compute_advantages("remax", rewards, singles, reward_baselines=baselines).tolist() == rewards.tolist()


def test_opo_length_weighted_baseline():
    # group 0: b = (2*1 + 1*0) / 3 = 2/3; group 1: b = (3*2 + 2*0) / 5 = 1.2
    adv = compute_advantages("opo", REWARDS, GROUPS, mask=MASK)
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 0.8, -1.2], rel=1e-12)


def test_opo_group_of_empty_completions_has_zero_baseline():
    adv = compute_advantages("opo", torch.tensor([1.0, 3.0], dtype=D), torch.tensor([0, 0]),
                             mask=torch.zeros(2, 2, dtype=D))
    assert adv.tolist() == [1.0, 3.0]


def test_grpo_passk_only_the_unique_best_gets_the_gap():
    rewards = torch.tensor([1, 0, 0.5, 1, 1, 0, 0.25, 0, 0.75], dtype=D)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    # g0: gap 1 - 0.5 = 0.5, std = 0.5 (devs .5, -.5, 0 -> var .5/2); g1: tie at the top -> 0;
    # g2: gap 0.75 - 0.25 = 0.5, mean 1/3, var = (1/144 + 16/144 + 25/144) / 2 = 21/144
    adv = compute_advantages("grpo_passk", rewards, groups)
    expected = [0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0, 0, 0, 0.5 / (math.sqrt(21) / 12 + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)
    raw = compute_advantages("grpo_passk", rewards, groups, norm_adv_by_std=False)
    assert raw.tolist() == [0.5, 0, 0, 0, 0, 0, 0, 0, 0.5]


def test_gpg_alpha_is_batch_size_over_nonzero_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0], dtype=D)
    groups = torch.tensor([4, 4, 4, 9, 9, 9])
    # 4 non-zero rewards of 6: alpha = 1.5; group means 0.5 and 2/3
    adv, metrics = compute_advantages_with_metrics("gpg", rewards, groups)
    assert adv.tolist() == pytest.approx([0.75, -0.75, 0.0, 0.5, 0.5, -1.0], rel=1e-12)
    assert metrics["advantages/gpg_alpha"] == 1.5
    halved = compute_advantages("gpg", rewards, groups, f_norm=2.0)
    assert halved.tolist() == pytest.approx([0.375, -0.375, 0.0, 0.25, 0.25, -0.5], rel=1e-12)
    # no non-zero reward: alpha = N / 1, advantages 0
    assert compute_advantages("gpg", torch.zeros(4, dtype=D), GROUPS).tolist() == [0, 0, 0, 0]


def test_remax_subtracts_the_greedy_reward():
    adv = compute_advantages("remax", torch.tensor([1.0, 0.0, 1.0, 1.0]), GROUPS,
                             reward_baselines=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert adv.tolist() == [0.0, -1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="reward_baselines must be"):
        compute_advantages("remax", REWARDS, GROUPS, reward_baselines=torch.zeros(3))


HALF = math.log(0.5)  # pi_t = 0.5 for every sampled token below


def test_optimal_token_baseline_hand_values():
    # row0: 2 tokens, sum pi^2 = 0.5 -> w = 1 - 2*0.5 + 0.5 = 0.5 per token, W = [0.5, 1.0]; G = [1, 1]
    # row1: 1 token, sum pi^2 = 0.75 -> w = 0.75, W = [0.75]; G = [0]
    # B_0 = (1*0.5 + 0*0.75) / (0.5 + 0.75 + 1e-8) = 0.4; B_1 = 1*1.0 / (1.0 + 1e-8) (row0 alone)
    rewards, groups, mask = torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 0]), _mask([2, 1], 2)
    inputs = dict(mask=mask, old_log_probs=torch.full((2, 2), HALF, dtype=D),
                  sum_pi_squared=torch.tensor([[0.5, 0.5], [0.75, 0.75]], dtype=D))
    adv = compute_advantages("optimal_token_baseline", rewards, groups, **inputs)
    expected = [[1 - 0.5 / (1.25 + 1e-8), 1 - 1 / (1 + 1e-8)], [-0.5 / (1.25 + 1e-8), 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=D), rtol=1e-12, atol=1e-15)
    # zero tail: row0 is the unique longest (2 > 1): its baseline from position 1 on is 0, A = G = 1
    cut = compute_advantages("optimal_token_baseline", rewards, groups, handle_zero_tail=True, **inputs)
    assert cut[0, 1].item() == 1.0 and cut[0, 0].item() == pytest.approx(expected[0][0], rel=1e-12)


def test_tir_optimal_token_baseline_aligns_by_valid_token_not_position():
    # row0 mask [1, 0, 1] (a tool output in the middle), reward 1 on position 2; row1 mask [1, 1, 0], reward 0.
    # pi = 0.5, sum pi^2 = 0.5: w = 0.5 per valid token. Compacted: row0 W = [0.5, 1.0], G = [1, 1];
    # row1 W = [0.5, 1.0], G = [0, 0]. Slot k baseline: (1 * W_k) / (2 W_k) = 0.5 -> row0 +0.5, row1 -0.5.
    rewards, groups = torch.tensor([1.0, 0.0], dtype=D), torch.tensor([3, 3])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    inputs = dict(mask=mask, old_log_probs=torch.full((2, 3), HALF, dtype=D),
                  sum_pi_squared=torch.full((2, 3), 0.5, dtype=D))
    adv = compute_advantages("tir_optimal_token_baseline", rewards, groups, **inputs)
    half = 0.5 / (1.0 + 1e-8)
    expected = [[1 - half, 0.0, 1 - 1.0 / (2.0 + 1e-8)], [-half, -1.0 / (2.0 + 1e-8), 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=D), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "remax",
                                  "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_missing_per_token_input_is_a_clear_error(name):
    with pytest.raises(ValueError, match="needs the input"):
        compute_advantages(name, REWARDS, GROUPS)


@pytest.mark.parametrize("name", [e.value for e in VERL_ADVANTAGE_ESTIMATORS])
def test_shuffling_the_batch_permutes_the_advantages(name):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (8,), generator=gen).to(D)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    mask = _mask(torch.randint(1, 5, (8,), generator=gen).tolist(), 4)
    extra = {"mask": mask} if name in {"reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo"} else {}
    if name == "remax":
        extra = {"reward_baselines": torch.ones(8, dtype=D)}
    if name.endswith("optimal_token_baseline"):
        old = -torch.rand(8, 4, generator=gen, dtype=D)
        extra = {"mask": mask, "old_log_probs": old, "sum_pi_squared": old.exp() ** 2 + 0.1}
    perm = torch.randperm(8, generator=gen)
    base = compute_advantages(name, rewards, groups, **extra)
    shuffled = compute_advantages(name, rewards[perm], groups[perm], **{k: v[perm] for k, v in extra.items()})
    torch.testing.assert_close(shuffled, base[perm])


def test_grpo_module_remax_hook_samples_one_greedy_completion_per_prompt():
    from mmpo.algos.grpo import GRPOModule
    from mmpo.training.config import SamplingConfig

    calls = []

    def generate(rows, *, num_samples, max_new_tokens, do_sample):
        calls.append((list(rows), num_samples, max_new_tokens, do_sample))
        return SimpleNamespace(rows=list(rows))

    fake = SimpleNamespace(
        engine=SimpleNamespace(generate=generate), sampling=SamplingConfig(max_new_tokens=7),
        # greedy reward of a prompt: its "score" column
        compute_rewards=lambda rollout: (torch.tensor([r["score"] for r in rollout.rows]), {}),
    )
    rows = [{"score": 0.25}] * 2 + [{"score": 1.0}] * 2
    rollout = SimpleNamespace(rows=rows, group_ids=torch.tensor([5, 5, 2, 2]))
    baselines = GRPOModule.greedy_reward_baselines(fake, rollout)
    assert baselines.tolist() == [0.25, 0.25, 1.0, 1.0]
    assert calls == [([{"score": 1.0}, {"score": 0.25}], 1, 7, False)]  # one call, distinct prompts, greedy
