"""Policy losses: hand-computed values and gradients per variant, PPO parity, clipping gradients."""

import math

import pytest
import torch

from mmpo.core import dcpo_ratio_bounds, policy_loss

LOG = math.log


def _tokens(ratios, advantages, old=None, dtype=torch.float64):
    """One sequence per token (batch, 1) so token-mean == per-token mean; returns (lp, old, adv, mask)."""
    n = len(ratios)
    old_lp = torch.full((n, 1), -1.0, dtype=dtype) if old is None else torch.tensor(old, dtype=dtype).view(n, 1)
    lp = (old_lp + torch.tensor([LOG(r) for r in ratios], dtype=dtype).view(n, 1)).requires_grad_(True)
    return lp, old_lp, torch.tensor(advantages, dtype=dtype), torch.ones(n, 1, dtype=dtype)


# ----------------------------------------------------------------------------- PPO


def test_ppo_hand_values_and_gradients():
    lp, old, adv, mask = _tokens([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = policy_loss("ppo", lp, old, adv, mask)
    # token 0: r 1.5, A +1: -min(1.5, 1.2) = -1.2 (clipped high, no gradient)
    # token 1: r 0.5, A +1: -min(0.5, 0.8) = -0.5 (d/dl = -A r = -0.5)
    # token 2: r 0.5, A -1: -min(-0.5, -0.8) = 0.8 (clipped low, no gradient)
    # token 3: r 1.5, A -1: -min(-1.5, -1.2) = 1.5 (d/dl = -A r = 1.5)
    # token-mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15
    assert loss.item() == pytest.approx(0.15, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4], rel=1e-12)
    assert metrics["policy/clipfrac"].item() == 0.5
    assert metrics["policy/clipfrac_high"].item() == 0.25
    assert metrics["policy/clipfrac_low"].item() == 0.25
    assert metrics["policy/ratio_min"].item() == pytest.approx(0.5)
    assert metrics["policy/ratio_max"].item() == pytest.approx(1.5)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(1.0)
    # approx_kl = mean((r - 1) - log r) = [2 (0.5 - log 1.5) + 2 (-0.5 - log 0.5)] / 4
    expected_kl = (2 * (0.5 - LOG(1.5)) + 2 * (-0.5 - LOG(0.5))) / 4
    assert metrics["policy/approx_kl"].item() == pytest.approx(expected_kl, rel=1e-9)
    assert not any(v.requires_grad for v in metrics.values())


def test_ppo_asymmetric_clip_and_dual_clip():
    lp, old, adv, mask = _tokens([1.25, 4.0], [1.0, -1.0])
    loss, metrics = policy_loss("ppo", lp, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    # token 0: r 1.25 < 1.28 -> unclipped: -1.25 (grad -1.25)
    # token 1: r 4, A -1: PPO loss max(4, 1.2) = 4, dual clip caps at -c A = 3 (no gradient)
    assert loss.item() == pytest.approx((-1.25 + 3.0) / 2, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.25 / 2, 0.0], rel=1e-12)
    assert metrics["policy/clipfrac_dual"].item() == 0.5
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss("ppo", lp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\)"):
        policy_loss("ppo", lp, old, adv, mask, clip_low=1.0)


def _plain_ppo_clip(log_probs, old_log_probs, advantages, mask, eps):
    """CleanRL-style PPO-clip with a single eps and the masked token mean, written out."""
    ratio = torch.exp(log_probs - old_log_probs)
    adv = advantages.unsqueeze(-1)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - eps, 1 + eps)
    return (torch.max(pg1, pg2) * mask).sum() / mask.sum()


@pytest.mark.parametrize("eps", [0.1, 0.2])
def test_ppo_symmetric_token_mean_parity_with_plain_ppo_clip(eps):
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    lp = (old + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).to(torch.float64)
    loss, _ = policy_loss("ppo", lp, old, adv, mask, clip_low=eps, clip_high=eps)
    (grad,) = torch.autograd.grad(loss, lp)
    ref = _plain_ppo_clip(lp, old, adv, mask, eps)
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-14)


def test_clipped_tokens_zero_gradient_under_ppo_bounded_under_gppo():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    lp = (old + 0.5 * torch.randn(8, 12, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    mask = torch.ones(8, 12, dtype=torch.float64)
    ratio = torch.exp(lp.detach() - old)
    clipped_high = (adv > 0) & (ratio > 1.28)
    clipped_low = (adv < 0) & (ratio < 0.8)
    assert clipped_high.sum() > 3 and clipped_low.sum() > 3  # the test exercises both sides
    n = mask.sum()
    loss_ppo, _ = policy_loss("ppo", lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(loss_ppo, lp)
    assert (g_ppo[clipped_high | clipped_low] == 0).all()
    loss_gppo, _ = policy_loss("gppo", lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (g_gppo,) = torch.autograd.grad(loss_gppo, lp)
    # GPPO forward value equals clip-higher PPO
    assert loss_gppo.item() == pytest.approx(loss_ppo.item(), rel=1e-12)
    # clipped tokens: bounded, non-zero gradient -(1 + eps_h) A / n and -(1 - eps_l) A / n
    assert torch.allclose(g_gppo[clipped_high], (-1.28 * adv / n)[clipped_high])
    assert torch.allclose(g_gppo[clipped_low], (-0.8 * adv / n)[clipped_low])
    assert (g_gppo[clipped_high | clipped_low] != 0).all()
    # unclipped tokens: the same gradient as PPO
    free = ~(clipped_high | clipped_low)
    assert torch.allclose(g_gppo[free], g_ppo[free])


# ----------------------------------------------------------------------------- GSPO


def test_gspo_worked_vector():
    """GSPO paper (arXiv 2507.18071): sequence ratio and clip, eps_high 4e-4 (paper v2 §5.1);
    docs/algorithm_sources.md section 7."""
    # log-ratios (0.1, -0.1, 0.3) -> s = exp(mean) = exp(0.1) = 1.105171
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    lp = (old + torch.tensor([[0.1, -0.1, 0.3]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.float64)
    s = math.exp(0.1)
    # A > 0, eps_high 4e-4: the whole sequence is clipped: value -(1 + 4e-4) A, zero gradient
    loss, metrics = policy_loss("gspo", lp, old, torch.tensor([1.0], dtype=torch.float64), mask,
                                agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.0004, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.abs().max().item() == 0.0
    assert metrics["policy/clipfrac_high"].item() == 1.0
    assert metrics["policy/ratio_mean"].item() == pytest.approx(s, rel=1e-12)
    # A < 0: min(-s, -1.0004) = -s -> loss s; gradient per token -A s / |o| = 1.105171 / 3
    loss, _ = policy_loss("gspo", lp, old, torch.tensor([-1.0], dtype=torch.float64), mask,
                          agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(s, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, torch.full((1, 3), s / 3, dtype=torch.float64))


def test_gspo_token_form_matches_sequence_form_gradient():
    """With a per-sequence advantage the GSPO-token gradient equals plain GSPO's (paper section 4.3)."""
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    lp = (old + 0.01 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    eps = 0.05  # wide enough that nothing clips here
    loss, _ = policy_loss("gspo", lp, old, adv, mask, agg="seq-mean-token-mean", clip_low=eps, clip_high=eps)
    (grad,) = torch.autograd.grad(loss, lp)
    # plain GSPO: s_i = exp(masked mean of l - l_old); J = mean_i min(s_i A_i, clip(s_i) A_i)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    ref = torch.max(-adv * s, -adv * torch.clamp(s, 1 - eps, 1 + eps)).mean()
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-14)


# ----------------------------------------------------------------------------- GMPO


def test_gmpo_worked_vector():
    """GMPO official ``callsys/GMPO:train_zero_math_gmpo.py`` (mode ``gmpo``), clip 0.4
    (``scripts/qwen2.5-math-7b-gmpo.sh``); docs/algorithm_sources.md section 7."""
    old = torch.zeros(1, 2, dtype=torch.float64) - 1.0
    lp = (old + torch.tensor([[0.5, -0.5]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.float64)
    # A > 0, c = 0.4: D~ = (min(0.5, 0.4), -0.5) = (0.4, -0.5); rho = exp(-0.05) = 0.951229; loss -rho
    loss, metrics = policy_loss("gmpo", lp, old, torch.tensor([1.0], dtype=torch.float64), mask,
                                agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-math.exp(-0.05), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    # token 0 clipped (no gradient); token 1: d(-A rho)/dl = -A rho / |o| = -0.951229 / 2
    assert grad.flatten().tolist() == pytest.approx([0.0, -math.exp(-0.05) / 2], rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == 0.5
    # A < 0: D~ = (0.5, max(-0.5, -0.4)) = (0.5, -0.4); rho = exp(0.05); loss = +rho (A = -1)
    loss, metrics = policy_loss("gmpo", lp, old, torch.tensor([-1.0], dtype=torch.float64), mask,
                                agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(math.exp(0.05), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.flatten().tolist() == pytest.approx([math.exp(0.05) / 2, 0.0], rel=1e-12)
    assert metrics["policy/clipfrac_low"].item() == 0.5


def test_gmpo_sequence_loss_is_put_on_every_token_and_aggregation_is_honoured():
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = old.clone().requires_grad_(True)  # rho = 1
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)
    # sequence losses -1 and -2
    seq_mean, _ = policy_loss("gmpo", lp, old, adv, mask, agg="seq-mean-token-mean")
    assert seq_mean.item() == pytest.approx(-1.5)
    token_mean, _ = policy_loss("gmpo", lp, old, adv, mask, agg="token-mean")
    assert token_mean.item() == pytest.approx((3 * -1 + 1 * -2) / 4)  # length-weighted


# ----------------------------------------------------------------------------- GPPO


def test_gppo_worked_vector_and_general_beta():
    """GPPO official ``Kwai-Klear/KlearReasoner:verl/trainer/ppo/core_algos.py`` (``compute_gppo_loss``,
    ``compute_gppo_loss_general_beta``; beta_1 0.25 from ``ppo_trainer.yaml``); docs/algorithm_sources.md section 7."""
    lp, old, adv, mask = _tokens([1.5], [1.0])
    loss, metrics = policy_loss("gppo", lp, old, adv, mask, clip_high=0.28)
    # delta 1.5, A 1, eps_h 0.28: value -1.28, d loss / d log pi = -1.28 (PPO: 0)
    assert loss.item() == pytest.approx(-1.28, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.item() == pytest.approx(-1.28, rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == 1.0
    lp, old, adv, mask = _tokens([0.5], [-1.0])
    loss, _ = policy_loss("gppo", lp, old, adv, mask, clip_low=0.2, beta_low=0.25)
    # delta 0.5 < 0.8, A -1: value and gradient -A beta_low (1 - eps_l) = 0.25 * 0.8 = 0.2
    assert loss.item() == pytest.approx(0.2, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.item() == pytest.approx(0.2, rel=1e-12)


# ----------------------------------------------------------------------------- DCPO


def test_dcpo_bounds_worked_vectors():
    """DCPO official ``lime-RL/DCPO:verl/trainer/ppo/core_algos.py`` (``get_clip_low_high``); the q = 0.9,
    0.01 values match the README table; docs/algorithm_sources.md section 7."""
    old = torch.log(torch.tensor([0.9, 0.01, 1.0, 1e-4], dtype=torch.float64))
    low, high = dcpo_ratio_bounds(old, 0.16, 0.2)
    # q = 0.9: 0.5 + 0.5 sqrt(1 - 0.64/0.9) = 0.5 + 0.5 * 0.537484 = 0.768742
    #          0.5 + 0.5 sqrt(1 + 0.8/0.9) = 0.5 + 0.5 * 1.374369 = 1.187184
    assert low[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 - 0.64 / 0.9), rel=1e-12)
    assert low[0].item() == pytest.approx(0.7687, abs=1e-4)
    assert high[0].item() == pytest.approx(1.1872, abs=1e-4)
    # q = 0.01: 1 - 64 < 0 -> 0.5 ; 0.5 + 0.5 sqrt(81) = 5.0
    assert (low[1].item(), high[1].item()) == pytest.approx((0.5, 5.0), rel=1e-12)
    # q = 1e-4: 0.5 + 0.5 sqrt(8001) = 45.2 -> capped at 10
    assert high[3].item() == 10.0
    low, high = dcpo_ratio_bounds(old, 0.2, 0.28)
    # q = 1, eps (0.2, 0.28): [0.5 + 0.5 sqrt(0.2), 0.5 + 0.5 sqrt(2.12)] = [0.7236, 1.2280]
    assert (low[2].item(), high[2].item()) == pytest.approx((0.723607, 1.228011), abs=1e-6)


def test_dcpo_loss_uses_probability_dependent_bounds():
    # rare token (q = 0.01, range [0.5, 5]): r = 3 is inside, PPO-0.2 would clip it
    lp, old, adv, mask = _tokens([3.0, 6.0], [1.0, 1.0], old=[LOG(0.01), LOG(0.01)])
    loss, metrics = policy_loss("dcpo", lp, old, adv, mask)
    # token 0: -3 (grad -3) ; token 1: r 6 > 5 -> -5, no gradient
    assert loss.item() == pytest.approx((-3.0 - 5.0) / 2, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.flatten().tolist() == pytest.approx([-1.5, 0.0], rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == 0.5


# ----------------------------------------------------------------------------- ASPO


def test_aspo_worked_vector_positive_advantage():
    """ASPO official ``wizard-III/Archer2.0:verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_archer``),
    c = 3 (``scripts/train/run_archer2.0_qwen2.5_1.5b_math.sh``); docs/algorithm_sources.md section 7."""
    lp, old, adv, mask = _tokens([0.5, 0.25, 1.5], [1.0, 1.0, 1.0])
    loss, metrics = policy_loss("aspo", lp, old, adv, mask, agg="seq-mean-token-sum")
    # A = +1 (flipped IS, weight 1/r):
    #   r 0.5  -> weight 2 : value -1/0.5 = -2
    #   r 0.25 -> 1/r = 4 > c = 3 -> weight capped at 3 (soft dual clip): value -3
    #   r 1.5  > 1.2 -> clipped: value -1/1.2, weight 0
    # seq-mean-token-sum over 3 one-token sequences = plain mean of the token losses
    assert loss.item() == pytest.approx((-2.0 - 3.0 - 1 / 1.2) / 3, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.flatten().tolist() == pytest.approx([-2 / 3, -3 / 3, 0.0], rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == pytest.approx(1 / 3)
    assert metrics["policy/clipfrac_dual"].item() == pytest.approx(1 / 3)


def test_aspo_negative_advantage_is_ppo_like_with_soft_dual_clip():
    lp, old, adv, mask = _tokens([0.5, 1.5, 4.0], [-1.0, -1.0, -1.0])
    loss, _ = policy_loss("aspo", lp, old, adv, mask)
    # A = -1 (weight r): r 0.5 < 0.8 clipped: value 0.8, weight 0 ; r 1.5: value 1.5, weight 1.5
    #   r 4 > c = 3: weight capped at 3, gradient kept (PPO dual clip would give 0): value 3
    assert loss.item() == pytest.approx((0.8 + 1.5 + 3.0) / 3, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.flatten().tolist() == pytest.approx([0.0, 1.5 / 3, 3.0 / 3], rel=1e-12)


# ----------------------------------------------------------------------------- CISPO


def test_cispo_hand_values():
    lp, old, adv, mask = _tokens([1.5, 8.0, 0.5], [1.0, 1.0, -2.0], old=[LOG(0.2), LOG(0.1), LOG(0.4)])
    loss, metrics = policy_loss("cispo", lp, old, adv, mask)
    # log pi: log 0.3, log 0.8, log 0.2 ; weights sg(clip(r, -, 1 + 4)): 1.5, 5 (capped), 0.5 (no floor)
    # loss_t = -w A log pi: -1.5 * log 0.3, -5 * log 0.8, +2 * 0.5 * log 0.2
    expected = (-1.5 * LOG(0.3) - 5.0 * LOG(0.8) + 1.0 * LOG(0.2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    # gradient -w A per token: never dropped, bounded by the cap
    assert grad.flatten().tolist() == pytest.approx([-1.5 / 3, -5.0 / 3, 1.0 / 3], rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == pytest.approx(1 / 3)
    assert metrics["policy/clipfrac_low"].item() == 0.0
    loss, _ = policy_loss("cispo", lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, lp)
    # weights clip(r, 0.8, 1.2): 1.2, 1.2, 0.8
    assert grad.flatten().tolist() == pytest.approx([-1.2 / 3, -1.2 / 3, 1.6 / 3], rel=1e-12)


# ----------------------------------------------------------------------------- shared behaviour


def test_log_ratio_clamp_setting():
    lp, old, adv, mask = _tokens([1.0], [1.0])
    lp = (old + 30.0).requires_grad_(True)  # log-ratio 30 -> clamped at 20 (default) or 5
    _, metrics = policy_loss("ppo", lp, old, adv, mask)
    assert metrics["policy/ratio_max"].item() == pytest.approx(math.exp(20), rel=1e-9)
    _, metrics = policy_loss("ppo", lp, old, adv, mask, log_ratio_clamp=5.0)
    assert metrics["policy/ratio_max"].item() == pytest.approx(math.exp(5), rel=1e-9)


def test_input_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss("ppo", x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss("ppo", x, x, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        policy_loss("ppo", x, x, torch.zeros(2), torch.ones(2, 3), agg="sum")
