"""DPPO's ``loss`` setting: core losses on per-denoising-step log-probs, hand-checked on the golden tiny batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from golden_support import load_golden

from mmpo.robotics.config import merged_settings
from mmpo.robotics.dppo import DPPO_LOSSES, NOT_FOR_DPPO, DPPOModule
from mmpo.robotics.policy.dppo_math import denoising_discount, normalize_advantages, reduce_step_log_prob
from mmpo.core import POLICY_LOSSES

GENERATOR, GOLDEN = load_golden(Path(__file__).parent / "golden", "dppo_golden.json")
PAIRS, FT = GENERATOR.PAIRS, GENERATOR.FT_STEPS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(GENERATOR.build_checkpoint(tmp_path_factory.mktemp("dppo_loss_names")))


def _module(checkpoint: str, **overrides) -> DPPOModule:
    torch.manual_seed(0)
    return DPPOModule(checkpoint, **merged_settings(GENERATOR.SETTINGS, overrides)).double()


def _batch(module: DPPOModule, old_offset: float, shift: float = 0.0):
    """The golden batch: (obs, chains, ft_index, current log-probs, old, advantages, returns), old = current + offset
    noise + shift."""
    generator = torch.Generator().manual_seed(1)
    obs = torch.rand(PAIRS, 2, generator=generator, dtype=torch.float64) * 2 - 1
    chains = torch.randn(PAIRS, FT + 1, module.policy.horizon, 1, generator=generator, dtype=torch.float64)
    ft_index = torch.arange(FT).repeat(PAIRS // FT)
    advantages = torch.randn(PAIRS, generator=generator, dtype=torch.float64)
    returns = torch.randn(PAIRS, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        current = reduce_step_log_prob(
            module.policy.chain_step_log_prob(obs, chains, ft_index, min_logprob_std=module.chain.min_logprob_std),
            module.act_steps, module.chain.logprob_min, module.chain.logprob_max)
    old = current + old_offset * torch.randn(PAIRS, generator=generator, dtype=torch.float64) + shift
    return obs, chains, ft_index, current, old, advantages, returns


def _effective_advantages(module: DPPOModule, advantages: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
    return normalize_advantages(advantages) * denoising_discount(ft_index, FT, module.chain.gamma_denoise)


def test_explicit_ppo_is_the_golden_default(checkpoint):
    module = _module(checkpoint, loss={"name": "ppo"})
    obs, chains, ft_index, _, old, adv, returns = _batch(module, 0.15)
    pg_loss, value_loss, _, metrics = module.minibatch_loss(obs, chains, ft_index, old, adv, returns)
    assert pg_loss.item() == pytest.approx(GOLDEN["losses/policy"], rel=1e-9, abs=1e-12)
    assert float(metrics["policy/clipfrac"]) == pytest.approx(GOLDEN["metrics"]["policy/clipfrac"])


def test_sapo_on_policy_is_two_over_tau_times_advantage(checkpoint):
    module = _module(checkpoint, loss={"name": "sapo", "settings": {"tau_pos": 1.0, "tau_neg": 2.0}})
    obs, chains, ft_index, current, _, adv, returns = _batch(module, 0.15)
    pg_loss, _, ratio, metrics = module.minibatch_loss(obs, chains, ft_index, current, adv, returns)
    assert torch.allclose(ratio, torch.ones_like(ratio))
    effective = _effective_advantages(module, adv, ft_index)
    tau = torch.where(effective > 0, 1.0, 2.0).double()
    assert pg_loss.item() == pytest.approx(float((-2.0 / tau * effective).mean()), rel=1e-9)
    assert float(metrics["policy/clipfrac"]) == 0.0  # no clip: the per-step range is unused


def test_gpg_ignores_the_old_log_probs(checkpoint):
    module = _module(checkpoint, loss={"name": "gpg"})
    obs, chains, ft_index, current, old, adv, returns = _batch(module, 0.15)
    with_old = module.minibatch_loss(obs, chains, ft_index, old, adv, returns)[0]
    on_policy = module.minibatch_loss(obs, chains, ft_index, current, adv, returns)[0]
    expected = -(_effective_advantages(module, adv, ft_index) * current).mean()
    assert with_old.item() == pytest.approx(on_policy.item(), rel=1e-12)
    assert with_old.item() == pytest.approx(expected.item(), rel=1e-9)


def test_cispo_weights_are_clipped_by_each_pairs_denoising_step_range(checkpoint):
    module = _module(checkpoint, loss={"name": "cispo"})
    obs, chains, ft_index, current, old, adv, returns = _batch(module, 0.15)
    pg_loss, _, ratio, _ = module.minibatch_loss(obs, chains, ft_index, old, adv, returns)
    clip = module.clip_ranges[ft_index]
    assert bool(((ratio < 1 - clip) | (ratio > 1 + clip)).any())  # some weights are clipped
    weight = torch.minimum(torch.maximum(ratio, 1 - clip), 1 + clip)
    expected = -(weight * _effective_advantages(module, adv, ft_index) * current).mean()
    assert pg_loss.item() == pytest.approx(expected.item(), rel=1e-9)


def test_gppo_has_ppo_values_but_keeps_clipped_gradients(checkpoint):
    ppo, gppo = _module(checkpoint), _module(checkpoint, loss={"name": "gppo"})
    # r = e^0.5 on every pair: the clip binds on every A > 0 pair (PPO: no gradient there); on the golden batch
    # the pairs the noisy old log-probs clip have no parameter gradient under either loss
    obs, chains, ft_index, _, old, adv, returns = _batch(ppo, 0.0, shift=-0.5)
    losses, grads = [], []
    for module in (ppo, gppo):
        loss = module.minibatch_loss(obs, chains, ft_index, old, adv, returns)[0]
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in module.policy.ft_network.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)  # the forward value is clip-PPO's
    assert not torch.allclose(grads[0], grads[1])  # clipped pairs keep a bounded gradient under GPPO


def test_aspo_runs_with_the_per_step_clip(checkpoint):
    module = _module(checkpoint, loss={"name": "aspo"})
    obs, chains, ft_index, _, old, adv, returns = _batch(module, 0.15)
    pg_loss, _, _, metrics = module.minibatch_loss(obs, chains, ft_index, old, adv, returns)
    assert torch.isfinite(pg_loss) and 0 < float(metrics["policy/clipfrac"]) < 1


@pytest.mark.parametrize("name", sorted(NOT_FOR_DPPO))
def test_inapplicable_losses_fail_at_construction_with_the_reason(name):
    with pytest.raises(ValueError, match=rf"loss '{name}' does not apply to DPPO \(.+\); valid: \['ppo'"):
        DPPOModule("no-checkpoint-needed.ckpt", loss={"name": name})


def test_every_registered_loss_is_either_allowed_or_explained():
    assert set(DPPO_LOSSES) | set(NOT_FOR_DPPO) == set(POLICY_LOSSES.names())
    assert not set(DPPO_LOSSES) & set(NOT_FOR_DPPO)


def test_bad_loss_settings_fail_at_construction():
    with pytest.raises(ValueError, match="not a registered core loss"):
        DPPOModule("x.ckpt", loss={"name": "nope"})
    with pytest.raises(ValueError, match=r"loss.settings \['clip_low'\] are set by the per-denoising-step clip"):
        DPPOModule("x.ckpt", loss={"name": "cispo", "settings": {"clip_low": 0.5}})
    with pytest.raises(ValueError, match="tau_pos"):
        DPPOModule("x.ckpt", loss={"name": "sapo", "settings": {"tau_pos": -1.0}})
