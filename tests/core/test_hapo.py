"""HAPO's formulas (arXiv 2509.16591; starriver030515/HAPO core_algos.py), by hand."""

import math

import pytest
import torch

from mmpo.core import adaptive_temperature, compute_advantages_with_metrics, hapo_entropy_norm, policy_loss
from mmpo.core.hapo import hapo_clip_bounds, hapo_redistribute

E = math.e
# log-entropies x = [0, 1, 2, -1] (+ one padded token); pivot q 0.8: rank round(0.8 * 3) = 2 of sorted
# [-1, 0, 1, 2] -> m = 1; x - m = [-1, 0, 1, -2]; s = sqrt((1 + 0 + 1 + 4) / 4) = sqrt(1.5) = 1.224745
# h = [-0.816497, 0, 0.816497, -1.632993]; max(h > 0) = 0.816497, min(h < 0) = -1.632993
ENTROPY = torch.tensor([[1.0, E, E**2, E**-1, E**5]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_entropy_norm_official_and_signed():
    h_hat, stats = hapo_entropy_norm(ENTROPY, MASK)
    # official: h > 0 -> h / 0.816497; h <= 0 -> h / -1.632993 (>= 0): [0.5, 0, 1, 1]
    assert h_hat[0, :4].tolist() == pytest.approx([0.5, 0.0, 1.0, 1.0])
    assert stats.pivot == pytest.approx(1.0) and stats.scale == pytest.approx(math.sqrt(1.5))
    signed, _ = hapo_entropy_norm(ENTROPY, MASK, signed=True)
    assert signed[0, :4].tolist() == pytest.approx([-0.5, 0.0, 1.0, -1.0])  # the paper's intent


def test_adaptive_clip_and_redistribution_hand_computed():
    h_hat = torch.tensor([0.5, 0.0, 1.0, -1.0])
    low, high = hapo_clip_bounds(0.2, 0.2, h_hat, alpha=1.0)
    # low: h^ <= 0 -> 0.2 (1 - h^): pos 1: 0.2, pos 3: 0.4; high: h^ > 0 -> 0.2 (1 + h^): pos 0: 0.3, pos 2: 0.4
    assert low.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.4])
    assert high.tolist() == pytest.approx([0.3, 0.2, 0.4, 0.2])
    ratio = torch.tensor([1.0, 1.0, 1.3, 1.3])
    # A_ent = 1 + h^ = [1.5, 1, 2, 0]; zones (1 - low/2, 1 + high/2): (0.9, 1.15) in, (0.9, 1.1) in,
    # (0.9, 1.2) out, (0.8, 1.1) out -> [A, A_ent, A_ent, A] = [1, 1, 2, 1]
    out = hapo_redistribute(torch.ones(4), h_hat, ratio, low, high, beta=1.0)
    assert out.tolist() == pytest.approx([1.0, 1.0, 2.0, 1.0])
    # T (1 + tau clamp(h^, -1, 1)), tau 0.05: [1.025, 1.0, 1.05, 0.95]
    assert adaptive_temperature(1.0, h_hat, 0.05).tolist() == pytest.approx([1.025, 1.0, 1.05, 0.95])


def test_loss_hand_computed():
    ratio = torch.tensor([[1.0, 1.0, 1.3, 1.5]], dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = ratio.log().requires_grad_(True)
    entropy = ENTROPY[:, :4]
    loss, metrics = policy_loss("hapo", lp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 4,
                                dtype=torch.float64), entropy=entropy)
    # official h^ = [0.5, 0, 1, 1]: low all 0.2; high [0.3, 0.2, 0.4, 0.4]; A_ent = [1.5, 1, 2, 2]
    # zones (0.9, 1.15), (0.9, 1.1), (0.9, 1.2), (0.9, 1.2): r = 1, 1 in; 1.3, 1.5 out -> A = [1, 1, 2, 2]
    # -min(r A, clip(r, 0.8, 1 + high) A) = [-1, -1, -2.6, -min(3.0, 2.8) = -2.8]; token-mean -1.85
    assert loss.item() == pytest.approx(-1.85)
    (grad,) = torch.autograd.grad(loss, lp)
    # d/dl of -r A / 4 where unclipped: [-0.25, -0.25, -0.65, 0 (clipped at 1.4)]
    assert grad[0].tolist() == pytest.approx([-0.25, -0.25, -0.65, 0.0])
    assert metrics["policy/clipfrac"].item() == pytest.approx(0.25)
    assert metrics["policy/hapo_high_entropy"].item() == pytest.approx(0.75)
    plain, _ = policy_loss("ppo", ratio.log(), old, torch.ones(1, dtype=torch.float64), torch.ones(1, 4,
                           dtype=torch.float64))
    assert plain.item() == pytest.approx((-1 - 1 - 1.2 - 1.2) / 4)  # PPO clips both at 1.2
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss("hapo", lp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64))


def test_dual_clip_acts_on_the_redistributed_advantage():
    # one token, h^ = 1 would need a batch; with a single token h = 0 -> h^ = 0 (low branch, zone (0.9, 1.1))
    lp = torch.tensor([[math.log(20.0)]], dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss("hapo", lp, old, -torch.ones(1, dtype=torch.float64), torch.ones(1, 1,
                                dtype=torch.float64), entropy=torch.ones(1, 1, dtype=torch.float64))
    # r = 20 outside the zone, h^ = 0: A stays -1; PPO loss -min(-20, -1.2) = 20, capped at -c A = 10
    assert loss.item() == pytest.approx(10.0) and metrics["policy/clipfrac_dual"].item() == 1.0


def test_token_level_advantage_and_grpo_fallback():
    # group 0: rewards [1, 0, 0], lengths [1, 3, 4]: mu = 1/8, sigma^2 = (0.875^2 + 7 * 0.125^2) / 8 = 0.109375
    #   A = [0.875, -0.125, -0.125] / 0.330719 = [2.645751, -0.377964, -0.377964]
    # group 1: rewards [1, 0, 0], lengths [1, 13, 13]: p = 1/27, A_1 = sqrt(26) = 5.099 >= 5 -> GRPO:
    #   mean 1/3, unbiased std sqrt(1/3) -> [1.154700, -0.577350, -0.577350]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    lengths = [1, 3, 4, 1, 13, 13]
    mask = torch.zeros(6, 13, dtype=torch.float64)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    adv, metrics = compute_advantages_with_metrics("hapo", rewards, groups, mask=mask)
    sigma = math.sqrt(0.109375)
    expected = [0.875 / sigma, -0.125 / sigma, -0.125 / sigma, 2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3),
                -1 / 3 / math.sqrt(1 / 3)]
    assert adv.shape == (6, 13)
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-5)
    assert (adv[mask == 0] == 0).all()
    assert metrics["advantages/hapo_fallback_groups"] == 1.0
