"""The verl / TRL losses (sapo, gpg, clip_cov, kl_cov, luspo, vespo) and verl's KL names, hand-computed.

Parity with the peers' own functions on seeded batches is measured by bench/parity_peer_losses.py
(it needs a verl mirror and the TRL wheel); here every value is worked out by hand.
"""

import math

import pytest
import torch

from mmpo.core import BATCH_COUPLED_LOSSES, KL_KINDS, kl_penalty, policy_loss

F64 = torch.float64
sigmoid = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731


def _rows(log_ratios, advantages):
    """One token per row (batch, 1), old log-prob -1: token-mean is the plain mean over rows."""
    old = torch.full((len(log_ratios), 1), -1.0, dtype=F64)
    lp = (old + torch.tensor(log_ratios, dtype=F64).view(-1, 1)).requires_grad_(True)
    return lp, old, torch.tensor(advantages, dtype=F64), torch.ones_like(old)


# ----------------------------------------------------------------------------- KL names


def test_verl_kl_names_hand_values():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, -50.0]], dtype=F64)
    # l - l_ref = 1, -1, 50
    assert kl_penalty(lp, ref, "abs").tolist() == [[1.0, 1.0, 50.0]]
    assert kl_penalty(lp, ref, "kl").tolist() == [[1.0, -1.0, 50.0]]  # = k1
    assert kl_penalty(lp, ref, "mse").tolist() == [[0.5, 0.5, 1250.0]]  # = k2: 1/2 (l - l_ref)^2
    low_var = kl_penalty(lp, ref, "low_var_kl")
    # = k3 with its clamps: exp(-1) + 1 - 1 = 0.367879; exp(1) - 1 - 1 = 0.718282;
    # l_ref - l = -50 -> clamp -20 -> exp(-20) + 20 - 1 = 19.0 -> output clamp 10
    assert low_var[0].tolist() == pytest.approx([math.exp(-1), math.e - 2, 10.0], rel=1e-12)
    assert torch.equal(low_var, kl_penalty(lp, ref, "k3"))
    kl_penalty(lp, ref, "abs").sum().backward()
    assert lp.grad.tolist() == [[1.0, -1.0, 1.0]]  # d|l - l_ref|/dl = sign(l - l_ref)
    assert {"abs", "kl", "mse", "low_var_kl"} <= set(KL_KINDS)
    with pytest.raises(ValueError, match=r"unknown KL kind 'k2\+'.*'low_var_kl'"):
        kl_penalty(lp, ref, "k2+")


@pytest.mark.parametrize(("name", "base"), [("k1+", "k1"), ("kl+", "k1"), ("abs+", "abs"), ("k3+", "k3"),
                                            ("low_var_kl+", "k3")])
def test_straight_through_kl_names_keep_the_value_and_take_the_k2_gradient(name, base):
    lp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, -50.0]], dtype=F64)
    value = kl_penalty(lp, ref, name)
    assert torch.equal(value.detach(), kl_penalty(lp, ref, base).detach())  # e.g. k3+ keeps k3's clamps
    value.sum().backward()
    assert lp.grad.tolist() == [[1.0, -1.0, 50.0]]  # d/dl 0.5 (l - l_ref)^2 = l - l_ref


# ----------------------------------------------------------------------------- SAPO


def test_sapo_gate_hand_computed():
    lp, old, adv, mask = _rows([0.0, math.log(1.5), math.log(0.5)], [1.0, 1.0, -1.0])
    loss, metrics = policy_loss("sapo", lp, old, adv, mask)
    # gate f(r) = sigmoid(tau (r - 1)) 4 / tau; tau = 1 (A > 0) or 1.05 (A <= 0); loss -f(r) A
    # row 0: r 1, tau 1: f = 0.5 * 4 = 2 -> -2
    # row 1: r 1.5, tau 1: f = 4 sigmoid(0.5) = 2.489837 -> -2.489837
    # row 2: r 0.5, tau 1.05, A -1: f = sigmoid(-0.525) 4 / 1.05 = 1.415938 -> +1.415938
    s1, s2 = sigmoid(0.5), sigmoid(-0.525)
    expected = (-2.0 - 4 * s1 + s2 * 4 / 1.05) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # d/dl = -A 4 s (1 - s) r (the 1/tau cancels): row 0: -4 * 0.25 * 1 = -1 (plain policy gradient on-policy)
    grads = [-1.0, -4 * s1 * (1 - s1) * 1.5, 4 * s2 * (1 - s2) * 0.5]
    assert lp.grad.flatten().tolist() == pytest.approx([g / 3 for g in grads], rel=1e-12)
    assert metrics["policy/clipfrac"].item() == 0.0  # no hard clip


def test_sapo_honours_the_aggregation_and_checks_temperatures():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.2, 0.2]], dtype=F64))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    # on-policy every token's loss is -2: token-mean and seq-mean-token-mean both give -2, but
    # seq-mean-token-sum gives (-6 - 2) / 2 = -4 (verl would force seq-mean-token-mean: -2)
    assert policy_loss("sapo", lp, lp, adv, mask, agg="seq-mean-token-sum")[0].item() == pytest.approx(-4.0)
    assert policy_loss("sapo", lp, lp, adv, mask, agg="seq-mean-token-mean")[0].item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="tau_pos / tau_neg must be > 0"):
        policy_loss("sapo", lp, lp, adv, mask, tau_neg=0.0)


# ----------------------------------------------------------------------------- GPG


def test_gpg_is_minus_advantage_times_log_prob():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=F64)
    adv = torch.tensor([2.0], dtype=F64)
    # token-mean of -A l: -(2 * -1 + 2 * -2) / 2 = 3; d/dl = -A / 2 = -1; the old policy plays no part
    for old in (lp.detach(), lp.detach() - 5.0):
        loss, _ = policy_loss("gpg", lp, old, adv, mask)
        assert loss.item() == pytest.approx(3.0)
        (grad,) = torch.autograd.grad(loss, lp)
        assert grad.tolist() == [[-1.0, -1.0]]


# ----------------------------------------------------------------------------- Clip-Cov


def _cov_batch(old_shift_00: float = 0.0):
    # A = (3, -1): mean 1, centred (2, -2); l = [[-1, -3], [-1, -3]], mean -2, centred [[1, -1], [1, -1]]
    # cov = [[2, -2], [-2, 2]]: tokens (0, 0) and (1, 1) lie in the band (1, 5)
    lp = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], dtype=F64, requires_grad=True)
    old = lp.detach().clone()
    old[0, 0] -= old_shift_00
    return lp, old, torch.tensor([3.0, -1.0], dtype=F64), torch.ones(2, 2, dtype=F64)


def test_clip_cov_drops_band_tokens_the_clip_left_alone():
    lp, old, adv, mask = _cov_batch(old_shift_00=0.5)  # token (0, 0): r = e^0.5 = 1.65 > 1.2, A > 0: clipped
    loss, metrics = policy_loss("clip_cov", lp, old, adv, mask, clip_cov_ratio=0.5)  # budget int(0.5 * 4) = 2
    # only (1, 1) is a candidate ((0, 0) is PPO-clipped): its loss becomes 0
    # (0, 0): -3 * 1.2 = -3.6 (clipped); (0, 1): -3 * 1; (1, 0): -(-1) * 1 = 1; (1, 1): 0 -> (-3.6 - 3 + 1) / 4
    assert loss.item() == pytest.approx(-1.4)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.75, 0.25, 0.0])
    assert metrics["policy/clipfrac_cov"].item() == 0.25 and metrics["policy/clipfrac"].item() == 0.25


def test_clip_cov_draws_its_budget_with_the_generator():
    lp, old, adv, mask = _cov_batch()
    # default ratio 2e-4: budget max(int(2e-4 * 4), 1) = 1 of the two candidates (0, 0), (1, 1);
    # base losses [[-3, -3], [1, 1]]: dropping (0, 0) gives (-3 + 2) / 4, dropping (1, 1) (-6 + 1) / 4
    seen = set()
    for seed in range(8):
        loss, metrics = policy_loss("clip_cov", lp, old, adv, mask, generator=torch.Generator().manual_seed(seed))
        again, _ = policy_loss("clip_cov", lp, old, adv, mask, generator=torch.Generator().manual_seed(seed))
        assert loss.item() == again.item()  # same generator state, same draw
        assert loss.item() in (pytest.approx(-0.25), pytest.approx(-1.25))
        assert metrics["policy/clipfrac_cov"].item() == 0.25
        seen.add(round(loss.item(), 6))
    assert seen == {-0.25, -1.25}, "both candidates get drawn"
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        policy_loss("clip_cov", lp, old, adv, mask, clip_cov_ratio=0.0)


# ----------------------------------------------------------------------------- KL-Cov


def test_kl_cov_penalises_the_top_covariance_token():
    lp = torch.tensor([[-1.0, -3.0], [-1.0, -3.5]], dtype=F64, requires_grad=True)
    old = lp.detach().clone()
    old[1, 1] -= 0.2  # log r = 0.2 on token (1, 1)
    adv = torch.tensor([3.0, -1.0], dtype=F64)
    mask = torch.ones(2, 2, dtype=F64)
    # mean l = -2.125; centred A (2, -2); cov = [[2 * 1.125, 2 * -0.875], [-2 * 1.125, -2 * -1.375]]
    #        = [[2.25, -1.75], [-2.25, 2.75]]: the top-1 (max(1, int(2e-4 * 4))) is (1, 1)
    loss, metrics = policy_loss("kl_cov", lp, old, adv, mask)
    r = math.exp(0.2)
    # -A r everywhere, plus 0.1 |log r| on (1, 1): (-3 - 3 + 1 + (r + 0.1 * 0.2)) / 4
    assert loss.item() == pytest.approx((-5.0 + r + 0.02) / 4, rel=1e-12)
    loss.backward()
    # d/dl: -A r / 4, and (r + 0.1 sign(log r)) / 4 on (1, 1)
    assert lp.grad.flatten().tolist() == pytest.approx([-0.75, -0.75, 0.25, (r + 0.1) / 4], rel=1e-12)
    assert metrics["policy/kl_cov_frac"].item() == 0.25
    # ratio 0.5: top-2 also penalises (0, 0), whose log r = 0 adds nothing
    wider, metrics = policy_loss("kl_cov", lp, old, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    assert wider.item() == pytest.approx((-5.0 + r + 0.2) / 4, rel=1e-12)
    assert metrics["policy/kl_cov_frac"].item() == 0.5


def test_covariance_losses_select_per_batch_so_micro_batches_do_not_add_up():
    # why the cross-product additivity test leaves them out: each call picks its own top token
    lp = torch.tensor([[-1.0, -3.0], [-1.0, -3.5]], dtype=F64)
    old = lp - 0.2
    adv = torch.tensor([3.0, -1.0], dtype=F64)
    mask = torch.ones(2, 2, dtype=F64)
    _, full = policy_loss("kl_cov", lp, old, adv, mask)
    penalised_micro = sum(
        policy_loss("kl_cov", lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1])[1]["policy/kl_cov_frac"] * 2
        for i in range(2)
    )
    assert full["policy/kl_cov_frac"].item() * 4 == 1 and penalised_micro.item() == 2
    assert BATCH_COUPLED_LOSSES == {"clip_cov", "kl_cov", "hapo"}  # hapo: entropy statistics per batch


# ----------------------------------------------------------------------------- LUSPO


def test_luspo_scales_the_gspo_sequence_loss_by_length():
    old = torch.full((2, 2), -1.0, dtype=F64)
    lp = (old + torch.tensor([[0.1, 0.3], [-0.001, 0.0]], dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, metrics = policy_loss("luspo", lp, old, adv, mask, agg="seq-mean-token-mean")
    # row 0: s = e^0.2 = 1.2214 > 1 + 2.5e-3, A > 0: clipped, -1.0025, times |o| 2: -2.005 (no gradient)
    # row 1: s = e^-0.001 = 0.9990005 inside [0.998, 1.0025], A < 0: +s, times |o| 1
    s1 = math.exp(-0.001)
    assert loss.item() == pytest.approx((-2.005 + s1) / 2, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, s1 / 2, 0.0], rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == pytest.approx(2 / 3)
    # = GSPO summed over each sequence's tokens (TRL's luspo aggregation), same clip range
    gspo, _ = policy_loss("gspo", lp, old, adv, mask, agg="seq-mean-token-sum", clip_low=2e-3, clip_high=2.5e-3)
    assert loss.item() == pytest.approx(gspo.item(), rel=1e-12)


# ----------------------------------------------------------------------------- VESPO


def test_vespo_gamma_weight_hand_computed():
    old = torch.full((2, 2), -1.0, dtype=F64)
    lp = (old + torch.tensor([[0.1, 0.2], [-0.5, 7.0]], dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)  # row 1's second token is padding
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, metrics = policy_loss("vespo", lp, old, adv, mask)
    # row 0: W = e^(0.1 + 0.2) = e^0.3, A >= 0: k 2, lambda 3: phi = W^2 e^(3 (1 - W)) = 0.637898
    # row 1: W = e^-0.5 (padding left out of the sum), A < 0: k 3, lambda 2: phi = W^3 e^(2 (1 - W)) = 0.490141
    w0, w1 = math.exp(0.3), math.exp(-0.5)
    phi0, phi1 = w0**2 * math.exp(3 * (1 - w0)), w1**3 * math.exp(2 * (1 - w1))
    # loss -phi A l, token-mean over 3 tokens: l = (-0.9, -0.8, -1.5)
    expected = (-phi0 * (-0.9) - phi0 * (-0.8) + phi1 * (-1.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-phi0 / 3, -phi0 / 3, phi1 / 3, 0.0], rel=1e-12)
    assert metrics["policy/ratio_max"].item() == pytest.approx(w0)  # the sequence weight W


def test_vespo_on_policy_is_the_plain_policy_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=F64)
    for adv in (2.0, -2.0):  # phi(1) = 1 for both (k, lambda) pairs
        vespo, _ = policy_loss("vespo", lp, lp.detach(), torch.tensor([adv], dtype=F64), mask)
        gpg, _ = policy_loss("gpg", lp, lp.detach(), torch.tensor([adv], dtype=F64), mask)
        assert vespo.item() == pytest.approx(gpg.item(), rel=1e-12)
    with pytest.raises(ValueError, match="lambda_pos / lambda_neg must be > 0"):
        policy_loss("vespo", lp, lp.detach(), torch.tensor([1.0], dtype=F64), mask, lambda_neg=0.0)
