"""DPPO's per-denoising-step PPO quantities, hand-computed (arXiv 2409.00588, diffusion_ppo.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmpo.core import gae
from mmpo.robotics.policy.dppo_math import (
    RunningRewardScaler,
    clip_schedule,
    denoising_discount,
    normalize_advantages,
    reduce_step_log_prob,
)


def test_clip_schedule_exponential_ramp_hand_computed():
    eps = clip_schedule(10, 0.001, 0.01, 3.0)
    denominator = math.exp(3) - 1  # 19.0855...
    expected = [0.001 + 0.009 * (math.exp(3 * i / 9) - 1) / denominator for i in range(10)]
    assert eps.tolist() == pytest.approx(expected, rel=1e-6)
    assert eps[0].item() == pytest.approx(0.001)  # noisiest fine-tuned step
    assert eps[4].item() == pytest.approx(0.001 + 0.009 * (3.793668 - 1) / 19.085537, rel=1e-5)  # = 0.0023174
    assert eps[-1].item() == pytest.approx(0.01)  # final step
    assert clip_schedule(2).tolist() == pytest.approx([0.001, 0.01])


def test_clip_schedule_single_finetuned_step_is_final_clip_not_nan():
    eps = clip_schedule(1, 0.001, 0.01, 3.0)
    assert eps.tolist() == pytest.approx([0.01])
    assert not torch.isnan(eps).any()
    with pytest.raises(ValueError, match="ft_steps"):
        clip_schedule(0)


def test_clip_schedule_constant_when_base_equals_final():
    assert clip_schedule(5, 0.01, 0.01).tolist() == pytest.approx([0.01] * 5)


def test_denoising_discount_hand_computed():
    # gamma^(K'-1-i) with K' = 3: i=0 -> 0.99^2 = 0.9801, i=1 -> 0.99, i=2 -> 1
    assert denoising_discount(torch.tensor([0, 1, 2]), 3, 0.99).tolist() == pytest.approx([0.9801, 0.99, 1.0])


def test_reduce_step_log_prob_clamps_keeps_executed_prefix_and_averages():
    elementwise = torch.tensor([[[1.0, 3.0], [-7.0, 0.0], [100.0, 100.0]]])  # (B=1, Ta=3, Da=2)
    # clamp to [-5, 2] -> [[1, 2], [-5, 0], ...]; keep act_steps = 2 rows; mean = (1 + 2 - 5 + 0) / 4 = -0.5
    assert reduce_step_log_prob(elementwise, act_steps=2).tolist() == pytest.approx([-0.5])
    # all 3 rows: (1 + 2 - 5 + 0 + 2 + 2) / 6 = 1/3
    assert reduce_step_log_prob(elementwise, act_steps=3).tolist() == pytest.approx([1 / 3])
    with pytest.raises(ValueError, match="act_steps"):
        reduce_step_log_prob(elementwise, act_steps=4)


def test_normalize_advantages_hand_computed():
    adv = torch.tensor([1.0, 2.0, 3.0])
    # mean 2, unbiased std 1 -> [-1, 0, 1]
    assert normalize_advantages(adv).tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)


def test_running_reward_scaler_hand_computed():
    scaler = RunningRewardScaler(num_envs=1, gamma=0.5)
    rewards = np.array([[1.0], [1.0]])
    starts = np.array([[True], [False]])
    scaled = scaler(rewards, starts)
    # discounted returns: 1, then 0.5 * 1 + 1 = 1.5 ; merged with prior (mean 0, var 1, count 1e-4)
    count = 1e-4 + 2
    mean = 1.25 * 2 / count
    var = (1.0 * 1e-4 + 0.0625 * 2 + 1.25**2 * 1e-4 * 2 / count) / count
    assert scaler.mean == pytest.approx(mean) and scaler.var == pytest.approx(var)
    assert scaled[:, 0].tolist() == pytest.approx([1 / math.sqrt(var + 1e-8)] * 2)
    # an episode start resets the running return: 0.5 * 1.5 * (1 - 1) + 2 = 2
    scaler(np.array([[2.0]]), np.array([[True]]))
    assert scaler.returns.tolist() == [2.0]
    with pytest.raises(ValueError, match="rewards and episode_start"):
        scaler(np.zeros((2, 3)), np.zeros((2, 3), dtype=bool))


def test_gae_over_chunk_steps_through_the_core_termination_vs_truncation():
    # one env, 3 chunk steps; gamma 0.5, lambda 0.5; rewards 1, values 0 except next_values
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    values = torch.zeros(3, 1)
    next_values = torch.tensor([[2.0], [4.0], [8.0]])
    # step 0 truncated (bootstraps V=2, cuts the recursion), step 1 terminated (no bootstrap), step 2 open
    terminated = torch.tensor([[False], [True], [False]])
    truncated = torch.tensor([[True], [False], [False]])
    adv, returns = gae(rewards, values, next_values, terminated, truncated, gamma=0.5, lam=0.5)
    # delta2 = 1 + 0.5 * 8 = 5 -> A2 = 5 ; delta1 = 1 (terminal) -> A1 = 1 (cut) ; delta0 = 1 + 0.5 * 2 = 2 -> A0 = 2 (cut)
    assert adv[:, 0].tolist() == pytest.approx([2.0, 1.0, 5.0])
    assert torch.equal(returns, adv + values)
