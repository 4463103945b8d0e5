"""HAPO: Heterogeneous Adaptive Policy Optimization (arXiv 2509.16591; official code ``starriver030515/HAPO``,
``verl/trainer/ppo/core_algos.py``: ``compute_entropy_h``, ``ada_clip``, ``ada_advantage``,
``compute_hapo_outcome_advantage``, ``compute_policy_loss``).

Pieces (sources: ``docs/algorithm_sources.md`` section 8, HAPO):

- :func:`hapo_entropy_norm`: per-token normalised entropy h^ from log-entropies around a pivot quantile;
- advantage estimator ``hapo``: token-level (length-weighted) group mean and population std, with the
  GRPO advantage as the group's fallback when any |A| >= 5;
- policy loss ``hapo``: asymmetric adaptive clip bounds and differential advantage redistribution from
  h^ of the update's own entropies (the loss takes ``entropy``), then PPO clip (dual clip c: the
  ``dual_clip`` setting, official 10);
- :func:`adaptive_temperature`: the sampler's T_t = T (1 + tau clamp(h^_t, -1, 1)), with h^_t from the
  token's entropy and the previous step's statistics (:class:`EntropyNormStats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, register_advantage_estimator
from mmpo.core.groups import GroupIndex
from mmpo.core.policy_loss import (
    Bound,
    PolicyLoss,
    RatioInputs,
    TokenLoss,
    _apply_dual_clip,
    check_clip_range,
    check_dual_clip,
    ppo_clip,
    register_ratio_loss,
)

_EPS = 1e-8  # compute_entropy_h's eps (log clamp, variance floor, scale floors)


@dataclass(frozen=True)
class EntropyNormStats:
    """Batch statistics of :func:`hapo_entropy_norm`: h = (log H - pivot) / scale; h^ = h * scale_pos
    for h > 0, h * scale_neg for h <= 0."""

    pivot: float
    scale: float
    scale_pos: float
    scale_neg: float

    def normalise(self, entropy: Tensor, *, signed: bool = False) -> Tensor:
        h = (torch.log(entropy.clamp_min(_EPS)) - self.pivot) / self.scale
        neg = abs(self.scale_neg) if signed else self.scale_neg  # scale_neg < 0: official h^ >= 0
        return torch.where(h > 0, h * self.scale_pos, h * neg)


def hapo_entropy_norm(
    entropy: Tensor, mask: Tensor, *, pivot_quantile: float = 0.8, signed: bool = False
) -> tuple[Tensor, EntropyNormStats]:
    """HAPO's normalised token entropy h^ ``(N, T)`` (no grad) and its statistics.

    x = log H (H clamped at 1e-8); m = the ``pivot_quantile`` quantile of x over masked-in tokens
    ("nearest" rank round(q (n - 1)), Python rounding, as the official ``torch_quantile``);
    s = sqrt(mean((x - m)^2)) over masked-in tokens (the RMS around the pivot, variance floored at 1e-8);
    h = (x - m) / s; h^ = h / max(h > 0) where h > 0, h / min(h < 0) where h <= 0 (scales floored at
    +-1e-8; max / min over masked-in tokens). The official code divides the h <= 0 branch by its
    (negative) minimum, so h^ >= 0 everywhere; ``signed=True`` keeps those tokens negative
    (h^ in [-1, 0]), the paper's stated intent (UNVERIFIED).
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if not 0.0 <= pivot_quantile <= 1.0:
        raise ValueError(f"HAPO entropy pivot quantile must be in [0, 1], got {pivot_quantile}")
    with torch.no_grad():
        valid = mask > 0
        work = entropy.detach().to(torch.promote_types(entropy.dtype, torch.float32))
        x = torch.log(work.clamp_min(_EPS))
        values = x[valid]
        if values.numel() == 0:
            pivot = 0.0
        else:
            rank = round(pivot_quantile * (values.numel() - 1))
            pivot = float(values.sort().values[rank])
        centred = x - pivot
        count = max(int(valid.sum()), 1)
        scale = max(float((centred.pow(2) * valid).sum()) / count, _EPS) ** 0.5
        h = centred / scale
        pos_max = max(float(torch.where(valid & (h > 0), h, torch.zeros_like(h)).max()), _EPS)
        neg_min = min(float(torch.where(valid & (h < 0), h, torch.zeros_like(h)).min()), -_EPS)
        stats = EntropyNormStats(pivot, scale, 1.0 / pos_max, 1.0 / neg_min)
        return stats.normalise(work, signed=signed).to(entropy.dtype), stats


def hapo_loss_settings(*, entropy_pivot: float, clip_alpha: float, adv_beta: float,
                       signed_entropy: bool) -> dict[str, float | bool]:
    """The ``hapo`` loss's own settings from the trainers' ``hapo_*`` options (VLM and dLLM modules)."""
    if not 0 <= entropy_pivot <= 1:
        raise ValueError(f"hapo_entropy_pivot must be in [0, 1], got {entropy_pivot}")
    return dict(entropy_pivot=entropy_pivot, clip_alpha=clip_alpha, adv_beta=adv_beta, signed_entropy=signed_entropy)


def hapo_module_loss_settings(loss: str | None, loss_settings: dict[str, Any] | None, *, entropy_pivot: float,
                              clip_alpha: float, adv_beta: float, signed_entropy: bool,
                              **hapo_extra: Any) -> dict[str, Any]:
    """A HAPO module's ``loss_settings``: the ``hapo`` loss's own options (and ``hapo_extra``, e.g. the dLLM
    module's dual clip) when ``loss`` is ``hapo`` (they only apply to HAPO's own loss), under the user's."""
    hapo_settings = {**hapo_loss_settings(entropy_pivot=entropy_pivot, clip_alpha=clip_alpha, adv_beta=adv_beta,
                                          signed_entropy=signed_entropy), **hapo_extra}
    return {**(hapo_settings if loss == "hapo" else {}), **(loss_settings or {})}


def adaptive_temperature(temperature: float, h_hat: Tensor, tau: float) -> Tensor:
    """HAPO's per-token sampling temperature T (1 + tau clamp(h^, -1, 1)) (the patched vLLM sampler)."""
    return temperature * (1.0 + tau * h_hat.clamp(-1.0, 1.0))


def hapo_clip_bounds(clip_low: Bound, clip_high: Bound, h_hat: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """``ada_clip``: eps_low (1 - alpha h^) where h^ <= 0, eps_high (1 + alpha h^) where h^ > 0, else unchanged."""
    low = torch.as_tensor(clip_low, dtype=h_hat.dtype, device=h_hat.device).expand_as(h_hat)
    high = torch.as_tensor(clip_high, dtype=h_hat.dtype, device=h_hat.device).expand_as(h_hat)
    low = torch.where(h_hat <= 0, low * (1.0 - h_hat * alpha), low)
    high = torch.where(h_hat > 0, high * (1.0 + h_hat * alpha), high)
    return low, high


def hapo_redistribute(advantages: Tensor, h_hat: Tensor, ratio: Tensor, clip_low: Tensor, clip_high: Tensor,
                      beta: float) -> Tensor:
    """``ada_advantage``: A_ent = A (1 + beta h^); inside the neutral zone 1 - eps_low/2 < r < 1 + eps_high/2
    high-entropy tokens (h^ > 0) keep A and the others take A_ent; outside it the reverse."""
    entropic = advantages * (1.0 + beta * h_hat)
    inside = (ratio > 1.0 - clip_low / 2) & (ratio < 1.0 + clip_high / 2)
    high_entropy = torch.where(inside, advantages, entropic)
    low_entropy = torch.where(inside, entropic, advantages)
    return torch.where(h_hat > 0, high_entropy, low_entropy)


@register_advantage_estimator(AdvantageEstimator.HAPO)
def hapo_advantages(
    rewards: Tensor, index: GroupIndex, *, mask: Tensor, eps: float = 1e-6, fallback_threshold: float = 5.0
) -> tuple[Tensor, dict[str, float]]:
    """HAPO token-level group advantage ``(N, T)`` (official ``compute_hapo_outcome_advantage``).

    Per group, over its masked-in tokens: mu = sum_i |o_i| R_i / sum_i |o_i|, sigma = the population std
    of the token rewards; A_i = (R_i - mu) / (sigma + eps) on o_i's tokens. A group with any
    |A_i| >= ``fallback_threshold`` takes the GRPO advantage (unbiased std, eps) instead, counted in
    ``advantages/hapo_fallback_groups``. The official check also sees the padded positions (value
    -mu / (sigma + eps)), which depend on the batch's padding width; here only real tokens count.
    """
    if mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must be (N, T) with N = {rewards.shape[0]}, got {tuple(mask.shape)}")
    mask = mask.to(rewards.dtype)
    lengths = mask.sum(-1)
    tokens = index.sum(lengths)
    mean_g = index.sum(lengths * rewards) / tokens.clamp_min(1.0)
    centred = rewards - mean_g[index.inverse]
    std_g = (index.sum(lengths * centred.pow(2)) / tokens.clamp_min(1.0)).sqrt()
    token_adv = centred / (std_g[index.inverse] + eps)
    has_tokens = lengths > 0
    too_large = (token_adv.abs() >= fallback_threshold) & has_tokens
    fallback_g = index.sum(too_large.to(rewards.dtype)) > 0
    grpo = (rewards - index.mean(rewards)[index.inverse]) / (index.std(rewards)[index.inverse] + eps)
    advantages = torch.where(fallback_g[index.inverse], grpo, token_adv)
    return advantages.unsqueeze(-1) * mask, {"advantages/hapo_fallback_groups": float(fallback_g.sum())}


@register_ratio_loss(PolicyLoss.HAPO)
def hapo_loss(
    x: RatioInputs,
    *,
    entropy: Tensor | None = None,
    clip_low: Bound = 0.2,
    clip_high: Bound = 0.2,
    entropy_pivot: float = 0.8,
    clip_alpha: float = 1.0,
    adv_beta: float = 1.0,
    adaptive_clip: bool = True,
    adaptive_advantage: bool = True,
    signed_entropy: bool = False,
    dual_clip: float | None = 10.0,
) -> TokenLoss:
    """HAPO's loss (official ``compute_policy_loss``): h^ of this batch's entropies (``entropy`` (N, T),
    the policy's at update time, detached; GRPOModule passes it), adaptive clip bounds
    (:func:`hapo_clip_bounds`, ``clip_alpha``), advantage redistribution (:func:`hapo_redistribute`,
    ``adv_beta``), then PPO clip with those per-token bounds and the dual clip c (``dual_clip``, on the
    redistributed advantages as the official code; None disables). Official defaults: eps 0.2 / 0.2, pivot
    0.8, alpha 1, beta 1, c 10. ``signed_entropy``: see :func:`hapo_entropy_norm`. Logs
    ``policy/hapo_high_entropy`` (share of tokens with h^ > 0) and ``policy/clipfrac_dual``.
    """
    check_dual_clip(dual_clip)
    if entropy is None:
        raise ValueError("policy loss 'hapo' needs the per-token entropy at update time (setting 'entropy', "
                         "(batch, time)); GRPOModule passes it when loss is 'hapo'")
    check_clip_range(clip_low, clip_high)
    h_hat, _ = hapo_entropy_norm(entropy.expand_as(x.ratio), x.mask, pivot_quantile=entropy_pivot,
                                 signed=signed_entropy)
    h_hat = h_hat.to(x.ratio.dtype)
    low = torch.as_tensor(clip_low, dtype=x.ratio.dtype, device=x.ratio.device).expand_as(x.ratio)
    high = torch.as_tensor(clip_high, dtype=x.ratio.dtype, device=x.ratio.device).expand_as(x.ratio)
    if adaptive_clip:
        low, high = hapo_clip_bounds(low, high, h_hat, clip_alpha)
    advantages = x.advantages
    if adaptive_advantage:
        advantages = hapo_redistribute(advantages, h_hat, x.ratio.detach(), low, high, adv_beta)
    out = ppo_clip(x.ratio, advantages, 1.0 - low, 1.0 + high)
    loss, dual = _apply_dual_clip(out.loss, advantages, dual_clip)
    return TokenLoss(loss, out.ratio, out.clipped_low, out.clipped_high,
                     {"hapo_high_entropy": h_hat > 0, "clipfrac_dual": dual})
