"""Clipped policy-gradient losses over (batch, time) token log-probs.

Every loss has the shared signature
``fn(log_probs, old_log_probs, advantages, mask, *, aggregation, log_ratio_clamp, <settings>)
-> (loss, metrics)`` with ``advantages`` already broadcast to ``(batch, time)``, and is
registered by name; call them through :func:`policy_loss`. Each loss builds a per-token loss
matrix and reduces it with the :class:`Aggregation` it is given: the aggregation mode is
always honoured, never overridden (a verl wart). Sequence-level losses (GMPO) put their
sequence loss on every token of the sequence, so ``seq-mean-token-mean`` gives the paper's
(1/G) sum_i form and the other modes re-weight sequences accordingly.

Metrics (detached 0-d tensors, local to this batch): ``policy/clipfrac`` (tokens whose
gradient the clip changes), ``policy/clipfrac_low``, ``policy/clipfrac_high``,
``policy/approx_kl`` (k3 estimator mean((r - 1) - log r) of the token ratio, as CleanRL),
``policy/ratio_mean``, ``policy/ratio_min``, ``policy/ratio_max`` (of the ratio the loss
uses: token ratio, or the sequence ratio for GSPO / GMPO), plus variant-specific extras.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
from torch import Tensor

from mmpo.core._settings import check_settings
from mmpo.core.aggregate import AggregationMode, aggregate
from mmpo.core.masked import masked_mean
from mmpo.core.registry import Registry

Metrics = dict[str, Tensor]
PolicyLossFn = Callable[..., tuple[Tensor, Metrics]]


class PolicyLoss(str, Enum):
    """Built-in policy loss names."""

    PPO = "ppo"
    GSPO = "gspo"
    GMPO = "gmpo"
    GPPO = "gppo"
    DCPO = "dcpo"
    ASPO = "aspo"
    CISPO = "cispo"


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str | PolicyLoss) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn(log_probs, old_log_probs, advantages, mask, *, aggregation, log_ratio_clamp,
    **settings) -> (loss, metrics)`` under ``name``."""
    return POLICY_LOSSES.register(name)


@dataclass(frozen=True)
class Aggregation:
    """An aggregation mode with its (optional) global normalisers; see :func:`aggregate`."""

    mode: str | AggregationMode = "token-mean"
    global_tokens: int | float | Tensor | None = None
    global_seqs: int | float | Tensor | None = None
    norm_len: int | float | None = None

    def __call__(self, values: Tensor, mask: Tensor) -> Tensor:
        return aggregate(
            values, mask, self.mode,
            global_tokens=self.global_tokens, global_seqs=self.global_seqs, norm_len=self.norm_len,
        )


def policy_loss(
    name: str | PolicyLoss,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: str | AggregationMode = "token-mean",
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
    norm_len: int | float | None = None,
    log_ratio_clamp: float = 20.0,
    **settings,
) -> tuple[Tensor, Metrics]:
    """Policy-gradient loss ``name`` and its metrics.

    Args:
        name: a registered loss (see :class:`PolicyLoss`).
        log_probs: ``(batch, time)`` log pi_theta of the sampled tokens (requires grad).
        old_log_probs: ``(batch, time)`` log pi_old of the same tokens (no grad).
        advantages: ``(batch,)`` per sequence or ``(batch, time)`` per token.
        mask: ``(batch, time)`` 1 for real completion tokens.
        agg: aggregation mode, always honoured (see :mod:`mmpo.core.aggregate`).
        global_tokens, global_seqs, norm_len: forwarded to :func:`aggregate`.
        log_ratio_clamp: l - l_old is clamped to [-c, c] before exp (verl / EasyR1: 20).
        **settings: the loss's own settings (unknown ones raise ValueError).

    Returns:
        ``(loss, metrics)``: 0-d loss and a dict of detached 0-d tensors.
    """
    fn = POLICY_LOSSES.get(name)
    key = name.value if isinstance(name, Enum) else name
    check_settings(
        fn, settings, family="policy loss", name=key, num_tensor_args=4, reserved=("aggregation", "log_ratio_clamp")
    )
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be (batch, time), got shape {tuple(log_probs.shape)}")
    for arg_name, tensor in (("old_log_probs", old_log_probs), ("mask", mask)):
        if tensor.shape != log_probs.shape:
            raise ValueError(f"{arg_name} shape {tuple(tensor.shape)} != log_probs shape {tuple(log_probs.shape)}")
    if advantages.shape == log_probs.shape[:1]:
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    elif advantages.shape != log_probs.shape:
        raise ValueError(
            f"advantages must be (batch,) or (batch, time) = {tuple(log_probs.shape)}, got {tuple(advantages.shape)}"
        )
    if log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be positive, got {log_ratio_clamp}")
    aggregation = Aggregation(agg, global_tokens, global_seqs, norm_len)
    mask_f = mask.to(log_probs.dtype)
    advantages = advantages.to(log_probs.dtype).detach()
    return fn(
        log_probs, old_log_probs.detach(), advantages, mask_f,
        aggregation=aggregation, log_ratio_clamp=log_ratio_clamp, **settings,
    )


# ----------------------------------------------------------------------------- helpers


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor, clamp: float) -> Tensor:
    return torch.clamp(log_probs - old_log_probs, min=-clamp, max=clamp)


def _straight_through(log_probs: Tensor) -> Tensor:
    """Value 1, gradient d log pi: multiplies a detached weight onto the score function."""
    return torch.exp(log_probs - log_probs.detach())


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def _check_dual(dual_clip: float | None) -> None:
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap of c * |A| on negative-advantage losses), got {dual_clip}")


def _apply_dual_clip(loss: Tensor, advantages: Tensor, dual_clip: float | None) -> tuple[Tensor, Tensor]:
    """Dual-clip PPO (arXiv 1912.09729): for A < 0 cap the loss at -c A (a constant: no gradient)."""
    if dual_clip is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    cap = -advantages * dual_clip
    binds = (advantages < 0) & (loss > cap)
    return torch.where(binds, cap, loss), binds


def _metrics(
    log_ratio: Tensor, ratio_used: Tensor, mask: Tensor, clipped_low: Tensor, clipped_high: Tensor, **extra: Tensor
) -> Metrics:
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        ratio_used = ratio_used.detach()
        valid = mask > 0
        any_valid = valid.any()
        fl = lambda b: masked_mean(b.to(mask.dtype), mask)  # noqa: E731
        low, high = fl(clipped_low), fl(clipped_high)
        metrics: Metrics = {
            "policy/clipfrac": fl(clipped_low | clipped_high),
            "policy/clipfrac_low": low,
            "policy/clipfrac_high": high,
            "policy/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "policy/ratio_mean": masked_mean(ratio_used, mask),
            "policy/ratio_min": torch.where(
                any_valid, torch.where(valid, ratio_used, torch.inf).min(), torch.ones((), dtype=ratio_used.dtype)
            ),
            "policy/ratio_max": torch.where(
                any_valid, torch.where(valid, ratio_used, -torch.inf).max(), torch.ones((), dtype=ratio_used.dtype)
            ),
        }
        for key, flag in extra.items():
            metrics[f"policy/{key}"] = fl(flag)
    return metrics


def _ppo_clip_tokens(
    ratio: Tensor, advantages: Tensor, low_bound: Tensor | float, high_bound: Tensor | float
) -> tuple[Tensor, Tensor, Tensor]:
    """-min(r A, clip(r, low, high) A) per token, with exact zero gradient where the clip binds."""
    low_t = torch.as_tensor(low_bound, dtype=ratio.dtype, device=ratio.device)
    high_t = torch.as_tensor(high_bound, dtype=ratio.dtype, device=ratio.device)
    clipped_ratio = torch.minimum(torch.maximum(ratio, low_t), high_t)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clipped_high = (advantages > 0) & (ratio > high_t)
    clipped_low = (advantages < 0) & (ratio < low_t)
    return loss, clipped_low, clipped_high


# ----------------------------------------------------------------------------- losses


@register_policy_loss(PolicyLoss.PPO)
def ppo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO-clip (arXiv 1707.06347) with decoupled bounds (DAPO clip-higher, arXiv 2503.14476).

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(l_t - l_old_t);
    with ``dual_clip`` c (arXiv 1912.09729, e.g. 3.0) the loss of A < 0 tokens is capped at -c A.
    Defaults 0.2 / 0.2 (DAPO uses clip_high 0.28).

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    _check_clip(clip_low, clip_high)
    _check_dual(dual_clip)
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    loss, clipped_low, clipped_high = _ppo_clip_tokens(ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    loss, dual = _apply_dual_clip(loss, advantages, dual_clip)
    return aggregation(loss, mask), _metrics(log_ratio, ratio, mask, clipped_low, clipped_high, clipfrac_dual=dual)


@register_policy_loss(PolicyLoss.GSPO)
def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO-token (arXiv 2507.18071): a length-normalised sequence ratio with per-token gradients.

    s_i = exp((1/|o_i|) sum_t (l_t - l_old_t)); s_it = sg(s_i) * pi_t / sg(pi_t) (value s_i);
    loss_t = -min(s_it A_t, clip(s_it, 1 - clip_low, 1 + clip_high) A_t). With a per-sequence
    advantage the gradient equals GSPO's. Paper defaults clip 3e-4 / 4e-4, no dual clip; the
    paper aggregates with ``seq-mean-token-mean`` (pass ``agg="seq-mean-token-mean"``).

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    _check_clip(clip_low, clip_high)
    _check_dual(dual_clip)
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (batch,)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    seq_ratio = torch.exp(token_log_ratio)
    loss, clipped_low, clipped_high = _ppo_clip_tokens(seq_ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    loss, dual = _apply_dual_clip(loss, advantages, dual_clip)
    return aggregation(loss, mask), _metrics(log_ratio, seq_ratio, mask, clipped_low, clipped_high, clipfrac_dual=dual)


@register_policy_loss(PolicyLoss.GMPO)
def gmpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[Tensor, Metrics]:
    """GMPO geometric-mean policy optimisation (arXiv 2507.20673), log-space token clipping.

    With D_t = l_t - l_old_t and the sequence advantage A_i (token mean of ``advantages``):
    A_i >= 0: D~_t = min(D_t, clip_high); A_i < 0: D~_t = max(D_t, -clip_low) (clipped tokens get
    no gradient); rho_i = exp((1/|o_i|) sum_t D~_t); sequence loss -A_i rho_i, put on each of its
    tokens. Official defaults: clip range (e^-0.4, e^0.4), i.e. clip_low = clip_high = 0.4 in log
    space; the paper aggregates per sequence (``agg="seq-mean-token-mean"``).

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``; averaged over each sequence's real tokens.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"GMPO log-space clip bounds must be >= 0, got ({clip_low}, {clip_high})")
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    seq_adv = masked_mean(advantages, mask, dim=-1).unsqueeze(-1)  # (batch, 1)
    positive = seq_adv >= 0  # A = 0 counts as positive (as the official code); its loss is 0 anyway
    high = torch.full_like(log_ratio, clip_high)
    low = torch.full_like(log_ratio, -clip_low)
    clipped_high = positive & (log_ratio > clip_high)
    clipped_low = ~positive & (log_ratio < -clip_low)
    clipped_log_ratio = torch.where(clipped_high, high, torch.where(clipped_low, low, log_ratio))
    seq_ratio = torch.exp(masked_mean(clipped_log_ratio, mask, dim=-1)).unsqueeze(-1)  # (batch, 1)
    seq_loss = -seq_adv * seq_ratio
    loss = seq_loss.expand_as(log_ratio)
    metrics = _metrics(
        log_ratio, seq_ratio.expand_as(log_ratio), mask,
        clipped_low & (seq_adv < 0), clipped_high & (seq_adv > 0),
    )
    return aggregation(loss, mask), metrics


@register_policy_loss(PolicyLoss.GPPO)
def gppo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    beta_low: float = 1.0,
    beta_high: float = 1.0,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """GPPO gradient-preserving clipping (Klear-Reasoner, arXiv 2508.07629).

    Forward value as clip-higher PPO; a clipped token keeps a bounded gradient:
    A > 0, r > 1 + clip_high: loss_t = -beta_high (1 + clip_high) A * r/sg(r)
    (gradient -beta_high (1 + clip_high) A d log pi, PPO gives 0);
    A < 0, r < 1 - clip_low: loss_t = -beta_low (1 - clip_low) A * r/sg(r);
    otherwise -r A. ``beta_low = beta_high = 1`` is the paper's setting (the "general form"
    uses beta_low 0.25-0.75). Recipe defaults clip 0.2 / 0.28; ``dual_clip`` optional (recipes: 10).

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    _check_clip(clip_low, clip_high)
    _check_dual(dual_clip)
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    preserved = ratio / ratio.detach()  # value 1, gradient d log pi (through the clamped log-ratio)
    clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low)
    loss = torch.where(
        clipped_high,
        -advantages * (beta_high * (1.0 + clip_high)) * preserved,
        torch.where(clipped_low, -advantages * (beta_low * (1.0 - clip_low)) * preserved, -advantages * ratio),
    )
    loss, dual = _apply_dual_clip(loss, advantages, dual_clip)
    return aggregation(loss, mask), _metrics(log_ratio, ratio, mask, clipped_low, clipped_high, clipfrac_dual=dual)


def dcpo_ratio_bounds(
    old_log_probs: Tensor, clip_low: float = 0.16, clip_high: float = 0.2, max_ratio: float = 10.0
) -> tuple[Tensor, Tensor]:
    """DCPO probability-dependent ratio bounds (arXiv 2509.02333).

    From |(p/q - 1) p| <= eps with q = pi_old: 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0)) <= r
    <= min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), max_ratio).

    Args:
        old_log_probs: ``(batch, time)`` log q.

    Returns:
        low, high bounds ``(batch, time)``.
    """
    q = torch.exp(old_log_probs)
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * clip_low / q, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * clip_high / q), max=max_ratio)
    return low, high


@register_policy_loss(PolicyLoss.DCPO)
def dcpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 0.16,
    clip_high: float = 0.2,
    max_ratio: float = 10.0,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """DCPO dynamic adaptive clipping (arXiv 2509.02333).

    PPO-clip with absolute, per-token bounds from :func:`dcpo_ratio_bounds` (rare tokens get a
    wider range). Defaults: eps 0.16 / 0.2 (paper table), upper bound capped at 10 (official
    code); the official recipe also uses dual clip 10 and eps 0.2 / 0.28.
    DCPO's SAS advantage (cross-step state) is not part of this loss.

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"DCPO clip_low / clip_high must be >= 0, got ({clip_low}, {clip_high})")
    _check_dual(dual_clip)
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    low, high = dcpo_ratio_bounds(old_log_probs, clip_low, clip_high, max_ratio)
    loss, clipped_low, clipped_high = _ppo_clip_tokens(ratio, advantages, low, high)
    loss, dual = _apply_dual_clip(loss, advantages, dual_clip)
    return aggregation(loss, mask), _metrics(log_ratio, ratio, mask, clipped_low, clipped_high, clipfrac_dual=dual)


@register_policy_loss(PolicyLoss.ASPO)
def aspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 3.0,
) -> tuple[Tensor, Metrics]:
    """ASPO asymmetric importance sampling (Archer2.0, arXiv 2510.06062; official code is the reference).

    Weight w on d log pi per token:
    A > 0 (flipped IS): r^ = min(r, 1 + clip_high), w = 1 / r^ (0 when r > 1 + clip_high);
    A <= 0 (PPO-like): r^ = max(r, 1 - clip_low), w = r^ (0 when r < 1 - clip_low).
    Soft dual clip: where the weight would exceed c (``dual_clip``, default 3) it is capped at c
    and the gradient is kept. The official code writes that capped branch as -A c log pi; here
    it is -A c pi/sg(pi): same gradient, value -A c instead of -A c log pi. The code's
    entropy-dependent eps (0.2 / 0.4 split at the 0.8 entropy quantile) is not included.

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    _check_clip(clip_low, clip_high)
    if dual_clip <= 1.0:
        raise ValueError(f"ASPO dual_clip must be > 1, got {dual_clip}")
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    score = _straight_through(log_probs)
    positive = advantages > 0
    low, high = 1.0 - clip_low, 1.0 + clip_high
    clipped_high = positive & (ratio > high)
    clipped_low = (advantages < 0) & (ratio < low)
    # A > 0: flipped weight 1/r^, value -A / r^; r^ frozen at the bound when clipped.
    r_pos = torch.where(ratio > high, torch.full_like(ratio, high), ratio)
    loss_pos = -advantages * (r_pos / r_pos.detach()) / r_pos.detach()
    dual_pos = positive & (1.0 / r_pos.detach() > dual_clip)
    # A <= 0: PPO weight r^, value -A r^; r^ frozen at the bound when clipped.
    r_neg = torch.where(ratio < low, torch.full_like(ratio, low), ratio)
    loss_neg = -advantages * r_neg
    dual_neg = (advantages < 0) & (r_neg.detach() > dual_clip)
    loss = torch.where(positive, loss_pos, loss_neg)
    dual = dual_pos | dual_neg
    loss = torch.where(dual, -advantages * dual_clip * score, loss)
    return aggregation(loss, mask), _metrics(log_ratio, ratio, mask, clipped_low, clipped_high, clipfrac_dual=dual)


@register_policy_loss(PolicyLoss.CISPO)
def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation,
    log_ratio_clamp: float,
    clip_low: float | None = None,
    clip_high: float = 4.0,
) -> tuple[Tensor, Metrics]:
    """CISPO clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t l_t: every token keeps a gradient
    (weight times d log pi). The paper leaves the floor off (``clip_low=None``) and tunes only
    the cap; its value is unpublished, so the default cap 1 + 4 = 5 follows ScaleRL
    (arXiv 2510.13786), as TRL recommends. Paper aggregation: token-mean.

    Args:
        log_probs, old_log_probs, mask: ``(batch, time)``.
        advantages: ``(batch, time)``.
    """
    if clip_low is not None and not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"CISPO clip_low must be None or in [0, 1], got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"CISPO clip_high must be >= 0, got {clip_high}")
    log_ratio = _log_ratio(log_probs, old_log_probs, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    low = None if clip_low is None else 1.0 - clip_low
    high = 1.0 + clip_high
    weight = torch.clamp(ratio.detach(), min=low, max=high)
    loss = -weight * advantages * log_probs
    clipped_high = ratio > high
    clipped_low = ratio < low if low is not None else torch.zeros_like(clipped_high)
    return aggregation(loss, mask), _metrics(log_ratio, ratio, mask, clipped_low, clipped_high)
