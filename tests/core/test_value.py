"""mmpo.core.value: token-level GAE, the clipped value loss and the RLHF token rewards, by hand and against verl's
``compute_gae_advantage_return`` / ``compute_value_loss`` (verl/trainer/ppo/core_algos.py, commit b178a3cd) and
TRL's PPO trainer (trl/trainer/ppo_trainer.py, ``PPOTrainer.train``, TRL 0.x; TRL 1.x no longer ships it),
transcribed below as the references."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.core.value import clipped_value_loss, rlhf_token_rewards, token_gae


# --------------------------------------------------------------------------- references, transcribed


def _verl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _verl_masked_whiten(values, mask):  # verl/utils/torch_functional.py
    mean = _verl_masked_mean(values, mask)
    centered = values - mean
    variance = _verl_masked_mean(centered**2, mask)
    variance = variance * mask.sum() / (mask.sum() - 1)  # masked_var(unbiased=True)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
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


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value):  # token-mean
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * _verl_masked_mean(clipped_vf_losses, response_mask)
    vf_clipfrac = _verl_masked_mean(torch.gt(vf_losses2, vf_losses1).to(vpreds.dtype), response_mask)  # float64 here
    return vf_loss, vf_clipfrac


def trl_gae(rewards, values, padding_mask, gamma, lam):
    """TRL's PPO: values and rewards zeroed on padding, recursion over every position, then whitened."""
    values = torch.masked_fill(values, padding_mask, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = _verl_masked_whiten(advantages, (~padding_mask).float())
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns


def trl_value_loss(vpred, mb_values, mb_return, padding_mask_p1, cliprange_value):
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    mask = (~padding_mask_p1).to(vpred.dtype)  # float64 here (TRL: .float())
    return 0.5 * _verl_masked_mean(vf_loss_max, mask), _verl_masked_mean((vf_losses2 > vf_losses1).to(vpred.dtype), mask)


# --------------------------------------------------------------------------- hand values


def test_token_gae_hand_computed():
    """One completion of 3 tokens, outcome 1 on the last, V = (0.5, 0.2, 0.4), gamma 1, lam 0.5:
    deltas (0 + 0.2 - 0.5, 0 + 0.4 - 0.2, 1 - 0.4) = (-0.3, 0.2, 0.6); A_2 = 0.6, A_1 = 0.2 + 0.5 * 0.6 = 0.5,
    A_0 = -0.3 + 0.5 * 0.5 = -0.05; returns A + V = (0.45, 0.7, 1.0)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    mask = torch.ones(1, 3)
    advantages, returns = token_gae(rewards, values, mask, gamma=1.0, lam=0.5, whiten=False)
    torch.testing.assert_close(advantages, torch.tensor([[-0.05, 0.5, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.45, 0.7, 1.0]]))


def test_token_gae_skips_a_tool_answer_inside_the_completion():
    """Tokens (a, tool, b): the masked-out tool token passes V(b) and A(b) back to a unchanged.
    gamma 0.9, lam 1: A_b = 1 - 0.4 = 0.6; A_a = 0 + 0.9 * 0.4 - 0.5 + 0.9 * 0.6 = 0.4."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.4]])  # the tool position's value is never read
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, _ = token_gae(rewards, values, mask, gamma=0.9, lam=1.0, whiten=False)
    assert float(advantages[0, 2]) == pytest.approx(0.6)
    assert float(advantages[0, 0]) == pytest.approx(0.9 * 0.4 - 0.5 + 0.9 * 0.6)


def test_clipped_value_loss_hand_computed():
    """V_old 0, clip 0.2, returns 1: V = 0.5 clips to 0.2 ((0.5-1)^2 = 0.25 < (0.2-1)^2 = 0.64: clipped);
    V = 0.1 stays (0.81 both); mean of max = (0.64 + 0.81) / 2, loss = 0.5 x that; clipfrac 1/2."""
    predicted = torch.tensor([[0.5, 0.1]], requires_grad=True)
    loss, clipfrac = clipped_value_loss(predicted, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                        clip_range=0.2)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert float(clipfrac) == pytest.approx(0.5)
    loss.backward()  # the clipped token's gradient flows through the clamp's bound: none to V
    torch.testing.assert_close(predicted.grad, torch.tensor([[0.0, 0.5 * 2 * (0.1 - 1.0) / 2]]))
    plain, _ = clipped_value_loss(predicted.detach(), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                  clip_range=None)
    assert float(plain) == pytest.approx(0.5 * (0.25 + 0.81) / 2)


def test_rlhf_token_rewards_outcome_on_the_last_token_minus_kl():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    outcome = torch.tensor([1.0, -1.0, 5.0])
    plain = rlhf_token_rewards(outcome, mask)
    torch.testing.assert_close(plain, torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    log_probs = torch.full((3, 3), -1.0)
    ref = torch.full((3, 3), -1.5)  # k1 = log pi - log pi_ref = 0.5 per generated token
    penalised = rlhf_token_rewards(outcome, mask, log_probs=log_probs, ref_log_probs=ref, kl_coef=0.1)
    torch.testing.assert_close(penalised, plain - 0.05 * mask)
    with pytest.raises(ValueError, match="needs log_probs and ref_log_probs"):
        rlhf_token_rewards(outcome, mask, kl_coef=0.1)


# --------------------------------------------------------------------------- parity


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 6, 1])
    mask = (torch.arange(6).expand(4, 6) < lengths.unsqueeze(1)).float()
    values = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    outcome = torch.randn(4, generator=generator, dtype=torch.float64)
    log_probs = -torch.rand(4, 6, generator=generator, dtype=torch.float64)
    ref = -torch.rand(4, 6, generator=generator, dtype=torch.float64)
    return mask.double(), values, outcome, log_probs, ref


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9)])
def test_token_gae_equals_verl_and_trl(gamma, lam):
    mask, values, outcome, log_probs, ref = _batch()
    rewards = rlhf_token_rewards(outcome, mask, log_probs=log_probs, ref_log_probs=ref, kl_coef=0.05)
    ours, our_returns = token_gae(rewards, values * mask, mask, gamma=gamma, lam=lam)
    theirs, their_returns = verl_compute_gae_advantage_return(rewards, values * mask, mask, gamma, lam)
    torch.testing.assert_close(ours, theirs * mask, atol=1e-12, rtol=0)  # ours is 0 off the mask
    torch.testing.assert_close(our_returns * mask, their_returns * mask, atol=1e-12, rtol=0)
    trl_advantages, trl_returns = trl_gae(rewards, values, mask == 0, gamma, lam)
    torch.testing.assert_close(ours, trl_advantages, atol=1e-12, rtol=0)
    torch.testing.assert_close(our_returns * mask, trl_returns * mask, atol=1e-12, rtol=0)


@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_clipped_value_loss_equals_verl_and_trl(clip):
    mask, values, outcome, _, _ = _batch(1)
    generator = torch.Generator().manual_seed(2)
    returns = values + 2 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    # predictions part of the way to the returns (some beyond the clip range: the clipped term is the larger)
    predicted = values + 0.6 * (returns - values) + 0.3 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    ours, our_clipfrac = clipped_value_loss(predicted, values, returns, mask, clip_range=clip)
    theirs, their_clipfrac = verl_compute_value_loss(predicted, returns, values, mask, clip)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-12)
    assert float(our_clipfrac) == pytest.approx(float(their_clipfrac), abs=1e-12) and 0 < float(our_clipfrac) < 1
    trl_loss, trl_clipfrac = trl_value_loss(predicted, values, returns, mask == 0, clip)
    assert float(ours) == pytest.approx(float(trl_loss), abs=1e-12)
    assert float(our_clipfrac) == pytest.approx(float(trl_clipfrac), abs=1e-12)
    assert math.isfinite(float(ours))
