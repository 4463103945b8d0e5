"""The shared policy-loss skeleton: tensor-valued clip bounds (per token / per row, as DPPO's
per-denoising-step schedule) and the registered ``igpo_sequence`` loss, hand-computed."""

import inspect
import math

import pytest
import torch

from mmpo.core import POLICY_LOSSES, policy_loss

LOG = math.log


def _rows(ratios, advantages):
    """One token per row (batch, 1): token-mean is the plain mean over rows."""
    old = torch.full((len(ratios), 1), -1.0, dtype=torch.float64)
    lp = (old + torch.tensor([LOG(r) for r in ratios], dtype=torch.float64).view(-1, 1)).requires_grad_(True)
    return lp, old, torch.tensor(advantages, dtype=torch.float64), torch.ones_like(old)


def test_ppo_per_row_tensor_clip_bounds_hand_computed():
    lp, old, adv, mask = _rows([1.2, 1.2, 0.85, 0.85], [1.0, 1.0, -1.0, -1.0])
    eps = torch.tensor([[0.1], [0.3], [0.1], [0.3]], dtype=torch.float32)  # e.g. one range per denoising step
    loss, metrics = policy_loss("ppo", lp, old, adv, mask, clip_low=eps, clip_high=eps)
    # row 0: r 1.2 > 1.1, A +1: clipped, -1.1, no gradient
    # row 1: r 1.2 < 1.3: -1.2, d/dl = -A r = -1.2
    # row 2: r 0.85 < 0.9, A -1: clipped, max(0.85, 0.9) = 0.9, no gradient
    # row 3: r 0.85 > 0.7: 0.85, d/dl = -A r = 0.85
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.9 + 0.85) / 4, rel=1e-7)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -1.2 / 4, 0.0, 0.85 / 4], rel=1e-12)
    assert metrics["policy/clipfrac"].item() == 0.5
    assert metrics["policy/clipfrac_high"].item() == 0.25 and metrics["policy/clipfrac_low"].item() == 0.25


def test_per_token_bounds_equal_the_same_tokens_as_rows():
    lp_rows, old_rows, adv_rows, _ = _rows([1.2, 1.2, 0.85, 0.85], [1.0, 1.0, -1.0, -1.0])
    eps_rows = torch.tensor([[0.1], [0.3], [0.1], [0.3]], dtype=torch.float64)
    by_rows, _ = policy_loss("ppo", lp_rows, old_rows, adv_rows, torch.ones(4, 1),
                             clip_low=eps_rows, clip_high=eps_rows)
    # the same four tokens as a (2, 2) batch with a (2, 2) bound tensor
    lp = lp_rows.detach().view(2, 2).requires_grad_(True)
    by_tokens, _ = policy_loss("ppo", lp, old_rows.view(2, 2), adv_rows.view(2, 2), torch.ones(2, 2),
                               clip_low=eps_rows.view(2, 2), clip_high=eps_rows.view(2, 2))
    assert by_tokens.item() == pytest.approx(by_rows.item(), rel=1e-12)


def _takes_clip_bounds(name: str) -> bool:
    params = inspect.signature(POLICY_LOSSES.get(name)).parameters
    return "clip_low" in params and "clip_high" in params


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES.names() if _takes_clip_bounds(n)])
def test_a_tensor_bound_filled_with_one_value_equals_the_float(name):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64) - 0.5
    base = old + 0.6 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.tensor([-1.0, 0.5, -0.25], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    low, high = 0.02, 0.03
    results = []
    for as_tensor in (False, True):
        bound = (lambda v: torch.full((3, 1), v, dtype=torch.float64)) if as_tensor else (lambda v: v)
        lp = base.clone().requires_grad_(True)
        # HAPO reads per-token entropy at update time: a stand-in, -log pi_old of the sampled token
        extra = {"entropy": -old} if "entropy" in inspect.signature(POLICY_LOSSES.get(name)).parameters else {}
        loss, metrics = policy_loss(name, lp, old, adv, mask, clip_low=bound(low), clip_high=bound(high), **extra)
        (grad,) = torch.autograd.grad(loss, lp)
        results.append((loss, grad, metrics))
    (loss_f, grad_f, m_f), (loss_t, grad_t, m_t) = results
    assert m_f["policy/clipfrac"].item() > 0, "the batch should exercise the clip"
    torch.testing.assert_close(loss_t, loss_f, rtol=0, atol=1e-15)
    torch.testing.assert_close(grad_t, grad_f, rtol=0, atol=1e-15)
    assert {k: float(v) for k, v in m_t.items()} == pytest.approx({k: float(v) for k, v in m_f.items()})


def test_tensor_bounds_are_checked():
    lp, old, adv, mask = _rows([1.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError, match=r"setting 'clip_low' of shape \(3, 1\) does not broadcast"):
        policy_loss("ppo", lp, old, adv, mask, clip_low=torch.full((3, 1), 0.2))
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\)"):
        policy_loss("ppo", lp, old, adv, mask, clip_low=torch.tensor([[0.2], [1.0]]))
    with pytest.raises(ValueError, match=r"clip_high must be >= 0"):
        policy_loss("gspo", lp, old, adv, mask, clip_high=torch.tensor([[0.2], [-0.1]]))


def test_igpo_sequence_ratio_over_all_positions_hand_computed():
    # one sequence, two positions, only the first in the loss mask; l - l_old = (0.2, -0.1)
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    lp = (old + torch.tensor([[0.2, -0.1]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = policy_loss("igpo_sequence", lp, old, adv, mask, ratio_mask=torch.ones_like(mask))
    s = math.exp((0.2 - 0.1) / 2)  # 1.0513 inside [0.8, 1.2]: unclipped
    assert loss.item() == pytest.approx(-s, rel=1e-12)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(s, rel=1e-12)
    loss.backward()
    # d(-s)/dl_t = -s / 2 at BOTH positions: the masked-out one gets gradient through s
    assert lp.grad.flatten().tolist() == pytest.approx([-s / 2, -s / 2], rel=1e-12)


def test_igpo_sequence_default_ratio_over_the_loss_mask_and_clip():
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    lp = (old + torch.tensor([[0.1, 0.7]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss("igpo_sequence", lp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    s = math.exp(0.1)  # mean over the loss mask only; padding neither counts nor gets gradient
    assert loss.item() == pytest.approx(-s, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-s, 0.0], rel=1e-12)
    # over all positions the ratio is e^0.4 > 1.2: clipped, value -1.2, no gradient
    lp.grad = None
    loss, metrics = policy_loss("igpo_sequence", lp, old, torch.tensor([1.0], dtype=torch.float64), mask,
                                ratio_mask=torch.ones_like(mask))
    assert loss.item() == pytest.approx(-1.2, rel=1e-12)
    assert metrics["policy/clipfrac_high"].item() == 1.0
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


def test_per_row_bounds_equal_one_call_per_clip_group_reweighted():
    # DPPO's former loop: each denoising step's pairs in their own call, re-weighted by their share
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(12, 1, generator=gen, dtype=torch.float64)
    lp = old + 0.2 * torch.randn(12, 1, generator=gen, dtype=torch.float64)
    adv = torch.randn(12, generator=gen, dtype=torch.float64)
    step = torch.tensor([0, 1, 2, 0, 1, 2, 2, 2, 1, 0, 0, 0])
    schedule = torch.tensor([0.01, 0.05, 0.1], dtype=torch.float64)
    one_call, metrics = policy_loss("ppo", lp, old, adv, torch.ones_like(lp),
                                    clip_low=schedule[step].unsqueeze(1), clip_high=schedule[step].unsqueeze(1))
    looped, clipfrac = 0.0, 0.0
    for i, eps in enumerate(schedule.tolist()):
        rows = step == i
        loss_i, metrics_i = policy_loss("ppo", lp[rows], old[rows], adv[rows], torch.ones_like(lp[rows]),
                                        clip_low=eps, clip_high=eps)
        looped += float(rows.sum()) / 12 * loss_i.item()
        clipfrac += float(rows.sum()) / 12 * metrics_i["policy/clipfrac"].item()
    assert 0 < clipfrac < 1
    assert one_call.item() == pytest.approx(looped, rel=1e-12)
    assert metrics["policy/clipfrac"].item() == pytest.approx(clipfrac, rel=1e-12)
