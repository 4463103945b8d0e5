"""Token rewards, token GAE and the clipped value loss (mmpo.core.value): hand values and parity with verl / TRL."""

from __future__ import annotations

import pytest
import torch

from mmpo.core import masked_whiten, outcome_token_rewards, token_gae, value_loss
from mmpo.core.kl import kl_penalty

# ---------------------------------------------------------------------- references, transcribed


def _verl_masked_mean(values, mask, axis=None):
    # verl/utils/torch_functional.py: masked_mean
    s = (values * mask).sum(axis=axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def _verl_masked_var(values, mask, unbiased=True):
    # verl/utils/torch_functional.py: masked_var
    mean = _verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = _verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def _verl_masked_whiten(values, mask, shift_mean=True):
    # verl/utils/torch_functional.py: masked_whiten
    mean, var = _verl_masked_mean(values, mask), _verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl-project/verl, verl/trainer/ppo/core_algos.py: compute_gae_advantage_return (transcribed)."""
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = _verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    """verl-project/verl, verl/trainer/ppo/core_algos.py: compute_value_loss (transcribed; token-mean agg_loss)."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)  # clip_by_value
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * _verl_masked_mean(clipped_vf_losses, response_mask)  # agg_loss "token-mean"
    vf_clipfrac = _verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def trl_value_loss(vpred, mb_values, mb_return, padding_mask_p1, cliprange_value):
    """huggingface/trl, trl/trainer/ppo_trainer.py: PPOTrainer.train, the value loss (transcribed)."""

    def masked_mean(values, mask):  # trl.trainer.utils.masked_mean (axis None)
        return (values * mask).sum() / mask.sum()

    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    return vf_loss, vf_clipfrac


def _fixed_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 6, generator=g)
    values = torch.randn(4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]],
                        dtype=torch.float32)
    return rewards, values, mask


# ---------------------------------------------------------------------- hand values


def test_token_gae_hand_values():
    # one row, 3 real tokens then 1 pad; outcome reward 1 at the last real token; gamma 0.9, lam 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 9.0]])  # the pad's value is ignored
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    advantages, returns = token_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=2: delta = 1 - 0.6 = 0.4, A = 0.4
    # t=1: delta = 0 + 0.9*0.6 - 0.4 = 0.14, A = 0.14 + 0.45*0.4 = 0.32
    # t=0: delta = 0 + 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.45*0.32 = 0.304
    torch.testing.assert_close(advantages, torch.tensor([[0.304, 0.32, 0.4, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.504, 0.72, 1.0, 9.0]]))


def test_token_gae_gamma_lam_one_is_reward_minus_value():
    # gamma = lam = 1 with an outcome reward: A_t = R - V_t on every real token
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [0.25, 0.75, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = token_gae(rewards, values, mask)
    torch.testing.assert_close(advantages, torch.tensor([[1.5, 1.0, 0.5], [-1.25, -1.75, 0.0]]))
    torch.testing.assert_close(returns[mask > 0], torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0]))


def test_token_gae_skips_masked_tokens_inside_a_row():
    # an observation token (mask 0) in the middle: value and advantage carry over it
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.25]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, _ = token_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # t=2: A = 1 - 0.25 = 0.75; t=1 (masked): carries 0.75; t=0: delta = 0 + 0.25 - 0.5 = -0.25, A = 0.5
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.75, 0.75]]))


def test_outcome_token_rewards_hand_values():
    scores = torch.tensor([1.0, -0.5, 3.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards, metrics = outcome_token_rewards(scores, mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 1.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics == {}
    # KL in the reward (k1): old - ref on each real token, times kl_coef 0.1
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, metrics = outcome_token_rewards(scores, mask, old_log_probs=old, ref_log_probs=ref, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0], [-0.1, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["ppo/kl_in_reward"] == pytest.approx((0.5 - 1.0 + 0.0 + 1.0 + 0.0) / 5)
    with pytest.raises(ValueError, match="needs old_log_probs"):
        outcome_token_rewards(scores, mask, kl_coef=0.1)


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.0]])
    returns = torch.tensor([[0.5, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, returns, old, mask, clip=0.2)
    # token 0: unclipped (1 - 0.5)^2 = 0.25; clipped V = 0.2 -> (0.2 - 0.5)^2 = 0.09; max 0.25
    # token 1: unclipped (0 - 1)^2 = 1; clipped V = 0 -> 1; max 1 (not strictly larger: no clip counted)
    # 0.5 * (0.25 + 1) / 2 tokens = 0.3125
    assert float(loss.detach()) == pytest.approx(0.3125)
    assert metrics["value/clipfrac"] == 0.0
    loss.backward()
    # d/dV 0.5 * mean: token 0 -> (1 - 0.5) / 2 = 0.25; token 1 -> (0 - 1) / 2 = -0.5; pad -> 0
    torch.testing.assert_close(values.grad, torch.tensor([[0.25, -0.5, 0.0]]))
    # a value past the clip whose clipped loss is larger: the clipped term wins and has no gradient
    values = torch.tensor([[1.0]], requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=0.5)
    assert float(loss.detach()) == pytest.approx(0.5 * 1.5**2) and metrics["value/clipfrac"] == 1.0
    loss.backward()
    assert float(values.grad) == 0.0
    unclipped, _ = value_loss(torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.ones(1, 1),
                              clip=None)
    assert float(unclipped) == pytest.approx(0.5)


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_token_gae_matches_verl(gamma, lam):
    rewards, values, mask = _fixed_inputs()
    ref_adv, ref_ret = verl_compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    advantages, returns = token_gae(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(returns, ref_ret)
    # verl whitens inside; mmpo's masked_whiten also zeroes the masked positions
    torch.testing.assert_close(masked_whiten(advantages, mask), ref_adv * mask)


@pytest.mark.parametrize("clip", [0.05, 0.5, 5.0])
def test_value_loss_matches_verl_and_trl(clip):
    g = torch.Generator().manual_seed(1)
    vpreds, returns, old = (torch.randn(4, 6, generator=g) for _ in range(3))
    _, _, mask = _fixed_inputs()
    loss, metrics = value_loss(vpreds, returns, old, mask, clip=clip)
    ref_loss, ref_clipfrac = verl_compute_value_loss(vpreds, returns, old, mask, clip)
    torch.testing.assert_close(loss, ref_loss)
    assert metrics["value/clipfrac"] == pytest.approx(float(ref_clipfrac))
    trl_loss, trl_clipfrac = trl_value_loss(vpreds, old, returns, mask == 0, clip)
    torch.testing.assert_close(loss, trl_loss)
    assert metrics["value/clipfrac"] == pytest.approx(float(trl_clipfrac))


def test_kl_in_reward_matches_verl_apply_kl_penalty():
    # verl/trainer/ppo/ray_trainer.py apply_kl_penalty: token_level_rewards = token_level_scores - beta * kld,
    # kld = kl_penalty(old_log_probs, ref_log_prob, kl_penalty) * response_mask; the score sits at the last token
    g = torch.Generator().manual_seed(2)
    old, ref = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    scores = torch.tensor([1.0, 0.0, -1.0, 0.5])
    _, _, mask = _fixed_inputs()
    token_level_scores = torch.zeros(4, 6)
    valid_response_length = mask.sum(-1).long()
    # verl writes at valid_response_length - 1 for right-padded rows; row 2 has a hole, its last real token is 3
    for i, last in enumerate([5, 2, 3, 4]):
        token_level_scores[i, last] = scores[i]
    assert valid_response_length.tolist() == [6, 3, 3, 5]
    for kind in ("kl", "low_var_kl"):
        expected = token_level_scores - 0.05 * kl_penalty(old, ref, kind) * mask
        rewards, _ = outcome_token_rewards(scores, mask, old_log_probs=old, ref_log_probs=ref, kl_coef=0.05,
                                           kl_kind=kind)
        torch.testing.assert_close(rewards, expected)
