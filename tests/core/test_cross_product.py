"""Every advantage estimator x every policy loss x every aggregation: shapes, finiteness, gradients,
and micro-batch / global-count additivity for every loss."""

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from mmpo.core import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    BATCH_COUPLED_LOSSES,
    POLICY_LOSSES,
    AdvantageEstimator,
    PolicyLoss,
    compute_advantages,
    policy_loss,
)

ESTIMATORS = [e.value for e in AdvantageEstimator]
_GOLDEN = importlib.util.spec_from_file_location("make_golden", Path(__file__).parent / "golden" / "make_golden.py")
make_golden = importlib.util.module_from_spec(_GOLDEN)
_GOLDEN.loader.exec_module(make_golden)
LOSSES = [p.value for p in PolicyLoss]


def _entropy_input(loss_name: str, old: torch.Tensor) -> dict:
    """HAPO reads per-token entropy at update time: a stand-in, -log pi_old of the sampled token."""
    takes = "entropy" in inspect.signature(POLICY_LOSSES.get(loss_name)).parameters
    return {"entropy": -old.detach()} if takes else {}


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.2, 0.9])
    batch, time = groups.numel(), 7
    old = torch.log_softmax(torch.randn(batch, time, 11, generator=gen), -1)[..., 0]
    lp = (old + 0.4 * torch.randn(batch, time, generator=gen)).requires_grad_(True)
    mask = torch.zeros(batch, time)
    for i, length in enumerate([7, 3, 5, 1, 6, 7, 2, 4]):
        mask[i, :length] = 1
    return rewards, groups, lp, old, mask


@pytest.mark.parametrize("agg", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimator_loss_aggregation_cross_product(estimator, loss_name, agg):
    rewards, groups, lp, old, mask = _batch()
    settings = {"generator": torch.Generator().manual_seed(0)} if estimator == "mapo_random_lambda" else {}
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get(estimator)).parameters
    if "mask" in params:  # per-token estimators (verl's) take the response mask, may return (N, T)
        settings["mask"] = mask
    if "reward_baselines" in params:  # ReMax: a greedy-rollout reward per sample
        settings["reward_baselines"] = torch.full_like(rewards, 0.5)
    if "static_values" in params:  # PVPO: a pre-estimated value per sample's prompt
        settings["static_values"] = torch.full_like(rewards, 0.4)
    if "budgets" in params:  # HBPO: each sample's subgroup budget and the reward's L_max
        settings["budgets"] = torch.tensor([2, 4] * (rewards.numel() // 2))
        settings["max_length"] = 7
    if "sum_pi_squared" in params:  # optimal token baseline: rollout-policy token statistics
        settings["old_log_probs"] = old
        settings["sum_pi_squared"] = old.exp() ** 2 + 0.05
    # structured-rollout estimators (brpo, treepo, segment, tppo): the golden artifact's stand-in inputs
    settings.update(make_golden.structured_inputs(estimator, rewards, groups, mask, old))
    adv = compute_advantages(estimator, rewards, groups, **settings)
    assert adv.shape in (rewards.shape, mask.shape) and torch.isfinite(adv).all()
    loss, metrics = policy_loss(loss_name, lp, old, adv, mask, agg=agg, **_entropy_input(loss_name, old))
    assert loss.ndim == 0 and torch.isfinite(loss)
    for key in ("clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"):
        value = metrics[f"policy/{key}"]
        assert value.ndim == 0 and torch.isfinite(value) and not value.requires_grad, key
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(grad).all()
    assert (grad[mask == 0] == 0).all(), "padding must get no gradient"
    assert grad[mask == 1].abs().sum() > 0, "real tokens must get gradient"


@pytest.mark.parametrize("loss_name", LOSSES)
def test_per_token_advantages_are_accepted(loss_name):
    _, _, lp, old, mask = _batch(1)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    loss, _ = policy_loss(loss_name, lp, old, adv, mask, **_entropy_input(loss_name, old))
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("agg", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", [name for name in LOSSES if name not in BATCH_COUPLED_LOSSES])
def test_microbatch_losses_with_global_counts_sum_to_full_batch(loss_name, agg):
    rewards, groups, lp, old, mask = _batch(3)
    lp = lp.detach().double().requires_grad_(True)
    old, mask = old.double(), mask.double()
    adv = compute_advantages("grpo", rewards.double(), groups)
    full, _ = policy_loss(loss_name, lp, old, adv, mask, agg=agg, norm_len=9)
    (full_grad,) = torch.autograd.grad(full, lp)
    global_tokens = mask.sum()
    global_seqs = (mask.sum(-1) > 0).sum()
    total = torch.zeros((), dtype=torch.float64)
    for piece in (slice(0, 3), slice(3, 4), slice(4, 8)):
        micro, _ = policy_loss(
            loss_name, lp[piece], old[piece], adv[piece], mask[piece], agg=agg,
            global_tokens=global_tokens, global_seqs=global_seqs, norm_len=9,
        )
        total = total + micro
    (micro_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(micro_grad, full_grad, atol=1e-14)
