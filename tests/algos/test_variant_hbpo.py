"""HBPO (arXiv 2507.15844): the budget-aware reward and the hierarchical advantage with hand-computed
values, the budget subgroups of a rollout, the module's rewards, and the tiny config through `mmpo fit`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BatchFeature

from mmpo.core import compute_advantages_with_metrics, hbpo_rewards
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, RewardConfig, merged_settings

C = [math.cos(math.pi * k / 8) for k in range(5)]  # cos(k pi / 8): 1, 0.923880, 0.707107, 0.382683, 0


def test_budget_reward_official_values():
    # official scale: L_max 4096, beta 4, alpha 1/4096; f(x) = 4 cos(pi x / 8192)
    correct = torch.tensor([True, True, False, True])
    lengths = torch.tensor([256, 1024, 256, 5000])
    budgets = torch.tensor([512, 512, 512, 512])
    f = lambda x: 4 * math.cos(math.pi * x / 8192)  # noqa: E731
    got = hbpo_rewards(correct, lengths, budgets, max_length=4096)
    # n 256 <= b: min(f(256) - 256/4096, f(512)) = min(3.980740 - 0.0625, 3.923141) = 3.918240
    # n 1024 > b: min(f(1024) - 512/4096, f(512)) = min(3.695518 - 0.125, 3.923141) = 3.570518
    # wrong -> 0; longer than L_max -> 0
    assert got.tolist() == pytest.approx([f(256) - 0.0625, f(1024) - 0.125, 0.0, 0.0], abs=1e-5)
    assert got[0] == pytest.approx(3.918240, abs=1e-5) and got[1] == pytest.approx(3.570518, abs=1e-5)
    # the paper's piecewise form: f(b) within the budget (3.923141), f(n) - alpha |n - b| beyond it
    piecewise = hbpo_rewards(correct, lengths, budgets, max_length=4096, form="piecewise")
    assert piecewise.tolist() == pytest.approx([f(512), f(1024) - 0.125, 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="reward form"):
        hbpo_rewards(correct, lengths, budgets, max_length=4096, form="cosine")


def test_hierarchical_advantage_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([4, 4, 4, 9, 9, 9])
    budgets = torch.tensor([2, 4, 2, 4, 2, 4])
    adv, metrics = compute_advantages_with_metrics("hbpo", rewards, groups, budgets=budgets, max_length=5)
    f2, f4 = 4 * math.cos(0.2 * math.pi), 4 * math.cos(0.4 * math.pi)  # 3.236068, 1.236068
    # group 4: mean 0.5, unbiased std 0.5 -> inter (1, -1, 0) (x 0.5 / (0.5 + 1e-6));
    # subgroups (4, b2) = {1, 0.5}: mean 0.75 -> intra 0.75 - f(2); (4, b4) = {0} -> intra -f(4)
    s4 = 0.5 / (0.5 + 1e-6)
    # group 9: rewards 1, 1, 0: mean 2/3, std sqrt(1/3) = 0.577350; (9, b4) = {1, 0}: 0.5; (9, b2) = {1}: 1
    d9 = 1 / 3 / (math.sqrt(1 / 3) + 1e-6)
    expected = [0.75 - f2 + s4, 0.0 - f4 - s4, 0.75 - f2,
                0.5 - f4 + d9, 1.0 - f2 + d9, 0.5 - f4 - 2 * d9]
    assert adv.tolist() == pytest.approx(expected, abs=1e-9)
    assert adv[0] == pytest.approx(-1.486070, abs=1e-6)  # the golden artifact's first value
    assert metrics["advantages/hbpo_intra_mean"] == pytest.approx(
        (2 * (0.75 - f2) - f4 + 2 * (0.5 - f4) + 1.0 - f2) / 6)
    with pytest.raises(ValueError, match="needs the input"):
        compute_advantages_with_metrics("hbpo", rewards, groups)


def _module(path, **settings):
    from mmpo.algos.hbpo import HBPOModule

    return HBPOModule(str(path), **merged_settings(dict(
        budgets=[3, 5], sampling={"num_generations": 4, "max_new_tokens": 4}, loss=LossConfig(beta=0.0),
        rewards=RewardConfig(timeout_s=None)), settings))


def test_rollout_has_one_subgroup_per_budget(variant_tiny_vlm):
    module = _module(variant_tiny_vlm)
    rows = make_items("count_shapes", 2, seed=0)
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rollout.extras["hbpo_budget"].tolist() == [3, 3, 5, 5, 3, 3, 5, 5]
    assert [r["id"] for r in rollout.rows] == [rows[0]["id"]] * 4 + [rows[1]["id"]] * 4
    tokenizer = module.processor.tokenizer
    for i, budget in enumerate(rollout.extras["hbpo_budget"].tolist()):
        prompt = tokenizer.decode(rollout.prompt_inputs["input_ids"][i], skip_special_tokens=False)
        assert prompt.endswith(f"<think> I will answer the question with {budget} tokens")


def test_module_rewards_hand_computed(variant_tiny_vlm, scripted_reward):
    from mmpo.vlm.rollout import Rollout

    weights = scripted_reward([1.0, 1.0, 1.0, 0.0])
    module = _module(variant_tiny_vlm, budgets=[4, 6], max_length=8, rewards={"weights": weights},
                     correctness_reward="scripted")
    rows = [{**make_items("count_shapes", 1, seed=0)[0], "assistant_prefix": "<think> I will"}] * 4
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0], [1] * 6])
    rollout = Rollout(rows=rows, group_ids=torch.zeros(4, dtype=torch.long), prompt_inputs=BatchFeature({}),
                      completion_ids=torch.zeros(4, 6, dtype=torch.long), completion_mask=mask,
                      texts=["a", "b", "c", "d"], extras={"hbpo_budget": torch.tensor([4, 4, 6, 6])})
    rewards, metrics = module.compute_rewards(rollout)
    # L_max 8, beta 4, alpha 1/8; f(x) = 4 cos(pi x / 16) = 4 cos(k pi / 8) for x = 2k
    # n 2, b 4: min(4 cos(pi/8) - 2/8, 4 cos(pi/4)) = min(3.445518, 2.828427) = 2.828427
    # n 6, b 4: min(4 cos(3pi/8) - 2/8, 2.828427) = 1.280734
    # n 2, b 6: min(4 cos(pi/8) - 4/8, 4 cos(3pi/8)) = min(3.195518, 1.530734) = 1.530734; wrong -> 0
    assert rewards.tolist() == pytest.approx([4 * C[2], 4 * C[3] - 0.25, 4 * C[3], 0.0], abs=1e-6)
    assert metrics["hbpo/correct_frac"] == 0.75
    assert metrics["hbpo/reward_mean/b4"] == pytest.approx((4 * C[2] + 4 * C[3] - 0.25) / 2, abs=1e-6)


def test_settings_are_checked(variant_tiny_vlm):
    with pytest.raises(ValueError, match="multiple"):
        _module(variant_tiny_vlm, sampling={"num_generations": 6}, budgets=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="budget_prompt"):
        _module(variant_tiny_vlm, budget_prompt="think briefly")
    with pytest.raises(ValueError, match="'hbpo'"):
        _module(variant_tiny_vlm, advantage={"name": "grpo"})


def test_tiny_config_trains_two_steps(fit_variant):
    logged = fit_variant("hbpo", "--model.init_args.sampling.num_generations=4",
                         "--model.init_args.budgets=[3,5]",
                         "--model.init_args.max_length=6")
    steps = [row for row in logged if row.get("hbpo/correct_frac")]
    assert len(steps) == 2
    assert all(float(r["hbpo/length_mean/b3"]) <= 6 and float(r["hbpo/length_mean/b5"]) <= 6 for r in steps)
