"""Clipped policy-gradient losses over (batch, time) token log-probs.

Every loss has the shared signature
``fn(log_probs, old_log_probs, advantages, mask, *, aggregation, log_ratio_clamp, <settings>)
-> (loss, metrics)`` with ``advantages`` already broadcast to ``(batch, time)``, and is
registered by name; call them through :func:`policy_loss`. Each loss builds a per-token loss
matrix and reduces it with the :class:`Aggregation` it is given: the aggregation mode is
always honoured, never overridden (a verl wart). Sequence-level losses (GMPO) put their
sequence loss on every token of the sequence, so ``seq-mean-token-mean`` gives the paper's
(1/G) sum_i form and the other modes re-weight sequences accordingly.

The built-in losses are written as *ratio rules* (:func:`register_ratio_loss`): a rule gets
the checked tensors and the clamped log-ratio (:class:`RatioInputs`) and returns its per-token
loss and clip flags (:class:`TokenLoss`); the shared skeleton does the log-ratio, the optional
dual clip, the aggregation and the metrics. Clip bounds may be floats or tensors broadcastable
to ``(batch, time)`` (per token, or per row such as DPPO's per-denoising-step schedule).

Metrics (detached 0-d tensors, local to this batch): ``policy/clipfrac`` (tokens whose
gradient the clip changes), ``policy/clipfrac_low``, ``policy/clipfrac_high``,
``policy/approx_kl`` (k3 estimator mean((r - 1) - log r) of the token ratio, as CleanRL),
``policy/ratio_mean``, ``policy/ratio_min``, ``policy/ratio_max`` (of the ratio the loss
uses: token ratio, or the sequence ratio for GSPO / GMPO / IGPO), plus variant-specific extras.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping

import torch
from torch import Tensor

from mmpo.core._settings import check_settings
from mmpo.core.aggregate import AggregationMode, aggregate
from mmpo.core.masked import masked_mean
from mmpo.core.registry import Registry

Metrics = dict[str, Tensor]
PolicyLossFn = Callable[..., tuple[Tensor, Metrics]]
Bound = float | Tensor  # a clip bound: one number, or a tensor broadcastable to (batch, time)


class PolicyLoss(str, Enum):
    """Built-in policy loss names."""

    PPO = "ppo"
    GSPO = "gspo"
    GMPO = "gmpo"
    GPPO = "gppo"
    DCPO = "dcpo"
    ASPO = "aspo"
    CISPO = "cispo"
    IGPO_SEQUENCE = "igpo_sequence"
    # the verl / TRL peers (mmpo.core.policy_loss_peers)
    SAPO = "sapo"
    GPG = "gpg"
    CLIP_COV = "clip_cov"
    KL_COV = "kl_cov"
    LUSPO = "luspo"
    VESPO = "vespo"
    # HAPO's entropy-adaptive loss (mmpo.core.hapo)
    HAPO = "hapo"


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def policy_loss_reads_entropy(name: str | PolicyLoss) -> bool:
    """Whether policy loss ``name`` takes the per-token policy entropy at update time (setting ``entropy``,
    e.g. HAPO's): the trainer must then compute it and pass it, detached."""
    return "entropy" in inspect.signature(POLICY_LOSSES.get(name)).parameters


def register_policy_loss(name: str | PolicyLoss) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn(log_probs, old_log_probs, advantages, mask, *, aggregation, log_ratio_clamp,
    **settings) -> (loss, metrics)`` under ``name`` (see :func:`register_ratio_loss` for the short form)."""
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


@dataclass(frozen=True)
class WeightedAggregation:
    """An :class:`Aggregation` that first multiplies the per-token values by fixed ``weights``
    (TRL's ``per_token_loss * importance_sampling_ratio``; verl's ``pg_losses * rollout_is_weights``)."""

    base: Aggregation
    weights: Tensor

    def __call__(self, values: Tensor, mask: Tensor) -> Tensor:
        return self.base(values * self.weights, mask)


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
    token_weights: Tensor | None = None,
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
        token_weights: optional ``(batch, time)`` weights (detached) multiplying the per-token loss
            before aggregation, e.g. rollout IS weights (:func:`~mmpo.core.rollout_is_weights`).
        **settings: the loss's own settings (unknown ones raise ValueError); a tensor-valued
            setting (e.g. a per-token ``clip_low``) must broadcast to ``(batch, time)``.

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
    for setting, value in settings.items():
        if isinstance(value, Tensor) and not _broadcasts_to(value.shape, log_probs.shape):
            raise ValueError(
                f"policy loss {key!r} setting {setting!r} of shape {tuple(value.shape)} does not broadcast to "
                f"log_probs shape {tuple(log_probs.shape)}"
            )
    if log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be positive, got {log_ratio_clamp}")
    if token_weights is not None and token_weights.shape != log_probs.shape:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} != log_probs shape {tuple(log_probs.shape)}")
    aggregation = Aggregation(agg, global_tokens, global_seqs, norm_len)
    if token_weights is not None:
        aggregation = WeightedAggregation(aggregation, token_weights.detach().to(log_probs.dtype))
    mask_f = mask.to(log_probs.dtype)
    advantages = advantages.to(log_probs.dtype).detach()
    return fn(
        log_probs, old_log_probs.detach(), advantages, mask_f,
        aggregation=aggregation, log_ratio_clamp=log_ratio_clamp, **settings,
    )


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


# ----------------------------------------------------------------------------- the skeleton


@dataclass(frozen=True)
class RatioInputs:
    """What a ratio rule sees: the checked ``(batch, time)`` tensors and the token ratio.

    ``old_log_probs`` and ``advantages`` are detached, ``mask`` is float,
    ``log_ratio = clamp(log_probs - old_log_probs, -c, c)`` and ``ratio = exp(log_ratio)``.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Tensor
    log_ratio: Tensor
    ratio: Tensor


@dataclass(frozen=True)
class TokenLoss:
    """A ratio rule's result: per-token loss ``(batch, time)``, the ratio it uses (for the
    ``policy/ratio_*`` metrics) and the tokens whose gradient its clip changed (A < 0: low,
    A > 0: high). ``flags`` are further boolean masks, logged as ``policy/<name>`` fractions."""

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    flags: Mapping[str, Tensor] = field(default_factory=dict)


RatioRule = Callable[..., TokenLoss]


def register_ratio_loss(name: str | PolicyLoss, *, dual_clip: bool = False) -> Callable[[RatioRule], PolicyLossFn]:
    """Register a policy loss given only its ratio / clip rule ``rule(x: RatioInputs, **settings) -> TokenLoss``.

    The registered loss clamps the log-ratio, calls the rule, optionally applies the dual clip
    (``dual_clip=True`` adds the setting ``dual_clip: float | None = None``: for A < 0 the loss
    is capped at -c A, arXiv 1912.09729, logged as ``policy/clipfrac_dual``), aggregates and
    computes the shared metrics. The rule's keyword parameters are the loss's settings.
    """

    def decorator(rule: RatioRule) -> PolicyLossFn:
        @functools.wraps(rule)
        def loss_fn(
            log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
            aggregation: Aggregation, log_ratio_clamp: float, **settings,
        ) -> tuple[Tensor, Metrics]:
            cap = settings.pop("dual_clip", None) if dual_clip else None
            check_dual_clip(cap)
            log_ratio = torch.clamp(log_probs - old_log_probs, min=-log_ratio_clamp, max=log_ratio_clamp)
            inputs = RatioInputs(log_probs, old_log_probs, advantages, mask, log_ratio, torch.exp(log_ratio))
            out = rule(inputs, **settings)
            loss, flags = out.loss, dict(out.flags)
            if dual_clip:
                loss, flags["clipfrac_dual"] = _apply_dual_clip(loss, advantages, cap)
            metrics = _metrics(log_ratio, out.ratio, mask, out.clipped_low, out.clipped_high, **flags)
            return aggregation(loss, mask), metrics

        # the settings check (check_settings) reads this signature: shared tensors, the reserved
        # keywords, the rule's own settings, then dual_clip
        kw = inspect.Parameter.KEYWORD_ONLY
        positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for n in ("log_probs", "old_log_probs", "advantages", "mask")]
        reserved = [inspect.Parameter("aggregation", kw), inspect.Parameter("log_ratio_clamp", kw)]
        own = [p.replace(kind=kw) for p in list(inspect.signature(rule).parameters.values())[1:]]
        dual = [inspect.Parameter("dual_clip", kw, default=None)] if dual_clip else []
        loss_fn.__signature__ = inspect.Signature(positional + reserved + own + dual)
        return POLICY_LOSSES.register(name)(loss_fn)

    return decorator


def ppo_clip(ratio: Tensor, advantages: Tensor, low: Bound, high: Bound) -> TokenLoss:
    """-min(r A, clip(r, low, high) A) per token, with exact zero gradient where the clip binds.

    ``low`` / ``high`` are absolute ratio bounds, floats or tensors broadcastable to ``ratio``."""
    low_t = torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)
    high_t = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
    clipped_ratio = torch.minimum(torch.maximum(ratio, low_t), high_t)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clipped_high = (advantages > 0) & (ratio > high_t)
    clipped_low = (advantages < 0) & (ratio < low_t)
    return TokenLoss(loss, ratio, clipped_low, clipped_high)


def check_clip_range(clip_low: Bound, clip_high: Bound) -> None:
    """PPO-style ranges: ``clip_low`` in [0, 1) and ``clip_high`` >= 0 (every element of a tensor)."""
    _require("clip_low", clip_low, lambda v: (v >= 0) & (v < 1), "in [0, 1)")
    _require("clip_high", clip_high, lambda v: v >= 0, ">= 0")


def check_dual_clip(dual_clip: float | None) -> None:
    """``dual_clip`` is None (off) or > 1."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap of c * |A| on negative-advantage losses), got {dual_clip}")


def _require(name: str, value: Bound | tuple[Bound, ...], ok: Callable[[Tensor], Tensor], expected: str) -> None:
    """Raise ``ValueError("<name> must be <expected>, got <value>")`` unless every element of
    ``value`` (a bound, or a tuple of bounds) is ok."""
    values = value if isinstance(value, tuple) else (value,)
    if not all(bool(ok(torch.as_tensor(v)).all()) for v in values):
        raise ValueError(f"{name} must be {expected}, got {value}")


def _straight_through(log_probs: Tensor) -> Tensor:
    """Value 1, gradient d log pi: multiplies a detached weight onto the score function."""
    return torch.exp(log_probs - log_probs.detach())


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


# ----------------------------------------------------------------------------- losses


@register_ratio_loss(PolicyLoss.PPO, dual_clip=True)
def ppo_loss(x: RatioInputs, *, clip_low: Bound = 0.2, clip_high: Bound = 0.2) -> TokenLoss:
    """PPO-clip (arXiv 1707.06347) with decoupled bounds (DAPO clip-higher, arXiv 2503.14476).

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(l_t - l_old_t);
    with ``dual_clip`` c (arXiv 1912.09729, e.g. 3.0) the loss of A < 0 tokens is capped at -c A.
    Defaults 0.2 / 0.2 (DAPO uses clip_high 0.28).
    """
    check_clip_range(clip_low, clip_high)
    return ppo_clip(x.ratio, x.advantages, 1.0 - clip_low, 1.0 + clip_high)


@register_ratio_loss(PolicyLoss.GSPO, dual_clip=True)
def gspo_loss(x: RatioInputs, *, clip_low: Bound = 3e-4, clip_high: Bound = 4e-4) -> TokenLoss:
    """GSPO-token (arXiv 2507.18071): a length-normalised sequence ratio with per-token gradients.

    s_i = exp((1/|o_i|) sum_t (l_t - l_old_t)); s_it = sg(s_i) * pi_t / sg(pi_t) (value s_i);
    loss_t = -min(s_it A_t, clip(s_it, 1 - clip_low, 1 + clip_high) A_t). With a per-sequence
    advantage the gradient equals GSPO's. Paper defaults clip 3e-4 / 4e-4, no dual clip; the
    paper aggregates with ``seq-mean-token-mean`` (pass ``agg="seq-mean-token-mean"``).
    """
    check_clip_range(clip_low, clip_high)
    return ppo_clip(gspo_token_ratio(x), x.advantages, 1.0 - clip_low, 1.0 + clip_high)


def gspo_token_ratio(x: RatioInputs) -> Tensor:
    """GSPO-token's ratio ``(batch, time)``: value s_i = exp(mean over the mask of l_t - l_old_t),
    gradient s_i d l_t per token (s_it = sg(s_i) pi_t / sg(pi_t))."""
    seq_log_ratio = masked_mean(x.log_ratio, x.mask, dim=-1)  # (batch,)
    return torch.exp(seq_log_ratio.detach().unsqueeze(-1) + x.log_probs - x.log_probs.detach())


@register_ratio_loss(PolicyLoss.GMPO)
def gmpo_loss(x: RatioInputs, *, clip_low: Bound = 0.4, clip_high: Bound = 0.4) -> TokenLoss:
    """GMPO geometric-mean policy optimisation (arXiv 2507.20673), log-space token clipping.

    With D_t = l_t - l_old_t and the sequence advantage A_i (token mean of ``advantages``):
    A_i >= 0: D~_t = min(D_t, clip_high); A_i < 0: D~_t = max(D_t, -clip_low) (clipped tokens get
    no gradient); rho_i = exp((1/|o_i|) sum_t D~_t); sequence loss -A_i rho_i, put on each of its
    tokens. Official defaults: clip range (e^-0.4, e^0.4), i.e. clip_low = clip_high = 0.4 in log
    space; the paper aggregates per sequence (``agg="seq-mean-token-mean"``).
    """
    _require("GMPO log-space clip bounds", (clip_low, clip_high), lambda v: v >= 0, ">= 0")
    log_ratio, mask = x.log_ratio, x.mask
    seq_adv = masked_mean(x.advantages, mask, dim=-1).unsqueeze(-1)  # (batch, 1)
    positive = seq_adv >= 0  # A = 0 counts as positive (as the official code); its loss is 0 anyway
    high = torch.as_tensor(clip_high, dtype=log_ratio.dtype, device=log_ratio.device)
    low = -torch.as_tensor(clip_low, dtype=log_ratio.dtype, device=log_ratio.device)
    clipped_high = positive & (log_ratio > high)
    clipped_low = ~positive & (log_ratio < low)
    clipped_log_ratio = torch.where(clipped_high, high, torch.where(clipped_low, low, log_ratio))
    seq_ratio = torch.exp(masked_mean(clipped_log_ratio, mask, dim=-1)).unsqueeze(-1)  # (batch, 1)
    loss = (-seq_adv * seq_ratio).expand_as(log_ratio)
    return TokenLoss(
        loss, seq_ratio.expand_as(log_ratio), clipped_low & (seq_adv < 0), clipped_high & (seq_adv > 0)
    )


@register_ratio_loss(PolicyLoss.GPPO, dual_clip=True)
def gppo_loss(
    x: RatioInputs,
    *,
    clip_low: Bound = 0.2,
    clip_high: Bound = 0.28,
    beta_low: float = 1.0,
    beta_high: float = 1.0,
) -> TokenLoss:
    """GPPO gradient-preserving clipping (Klear-Reasoner, arXiv 2508.07629).

    Forward value as clip-higher PPO; a clipped token keeps a bounded gradient:
    A > 0, r > 1 + clip_high: loss_t = -beta_high (1 + clip_high) A * r/sg(r)
    (gradient -beta_high (1 + clip_high) A d log pi, PPO gives 0);
    A < 0, r < 1 - clip_low: loss_t = -beta_low (1 - clip_low) A * r/sg(r);
    otherwise -r A. ``beta_low = beta_high = 1`` is the paper's setting (the "general form"
    uses beta_low 0.25-0.75). Recipe defaults clip 0.2 / 0.28; ``dual_clip`` optional (recipes: 10).
    """
    check_clip_range(clip_low, clip_high)
    ratio, advantages = x.ratio, x.advantages
    preserved = ratio / ratio.detach()  # value 1, gradient d log pi (through the clamped log-ratio)
    clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low)
    loss = torch.where(
        clipped_high,
        -advantages * (beta_high * (1.0 + clip_high)) * preserved,
        torch.where(clipped_low, -advantages * (beta_low * (1.0 - clip_low)) * preserved, -advantages * ratio),
    )
    return TokenLoss(loss, ratio, clipped_low, clipped_high)


def dcpo_ratio_bounds(
    old_log_probs: Tensor, clip_low: Bound = 0.16, clip_high: Bound = 0.2, max_ratio: float = 10.0
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


@register_ratio_loss(PolicyLoss.DCPO, dual_clip=True)
def dcpo_loss(
    x: RatioInputs, *, clip_low: Bound = 0.16, clip_high: Bound = 0.2, max_ratio: float = 10.0
) -> TokenLoss:
    """DCPO dynamic adaptive clipping (arXiv 2509.02333).

    PPO-clip with absolute, per-token bounds from :func:`dcpo_ratio_bounds` (rare tokens get a
    wider range). Defaults: eps 0.16 / 0.2 (paper table), upper bound capped at 10 (official
    code); the official recipe also uses dual clip 10 and eps 0.2 / 0.28.
    DCPO's SAS advantage (cross-step state) is not part of this loss.
    """
    _require("DCPO clip_low / clip_high", (clip_low, clip_high), lambda v: v >= 0, ">= 0")
    low, high = dcpo_ratio_bounds(x.old_log_probs, clip_low, clip_high, max_ratio)
    return ppo_clip(x.ratio, x.advantages, low, high)


@register_ratio_loss(PolicyLoss.ASPO)
def aspo_loss(x: RatioInputs, *, clip_low: Bound = 0.2, clip_high: Bound = 0.2, dual_clip: float = 3.0) -> TokenLoss:
    """ASPO asymmetric importance sampling (Archer2.0, arXiv 2510.06062; official code is the reference).

    Weight w on d log pi per token:
    A > 0 (flipped IS): r^ = min(r, 1 + clip_high), w = 1 / r^ (0 when r > 1 + clip_high);
    A <= 0 (PPO-like): r^ = max(r, 1 - clip_low), w = r^ (0 when r < 1 - clip_low).
    Soft dual clip: where the weight would exceed c (``dual_clip``, default 3) it is capped at c
    and the gradient is kept. The official code writes that capped branch as -A c log pi; here
    it is -A c pi/sg(pi): same gradient, value -A c instead of -A c log pi. The code's
    entropy-dependent eps (0.2 / 0.4 split at the 0.8 entropy quantile) is not included.
    """
    check_clip_range(clip_low, clip_high)
    if dual_clip <= 1.0:
        raise ValueError(f"ASPO dual_clip must be > 1, got {dual_clip}")
    ratio, advantages = x.ratio, x.advantages
    score = _straight_through(x.log_probs)
    positive = advantages > 0
    low = torch.as_tensor(1.0 - clip_low, dtype=ratio.dtype, device=ratio.device)
    high = torch.as_tensor(1.0 + clip_high, dtype=ratio.dtype, device=ratio.device)
    clipped_high = positive & (ratio > high)
    clipped_low = (advantages < 0) & (ratio < low)
    # A > 0: flipped weight 1/r^, value -A / r^; r^ frozen at the bound when clipped.
    r_pos = torch.where(ratio > high, high, ratio)
    loss_pos = -advantages * (r_pos / r_pos.detach()) / r_pos.detach()
    dual_pos = positive & (1.0 / r_pos.detach() > dual_clip)
    # A <= 0: PPO weight r^, value -A r^; r^ frozen at the bound when clipped.
    r_neg = torch.where(ratio < low, low, ratio)
    loss_neg = -advantages * r_neg
    dual_neg = (advantages < 0) & (r_neg.detach() > dual_clip)
    loss = torch.where(positive, loss_pos, loss_neg)
    dual = dual_pos | dual_neg
    loss = torch.where(dual, -advantages * dual_clip * score, loss)
    return TokenLoss(loss, ratio, clipped_low, clipped_high, flags={"clipfrac_dual": dual})


@register_ratio_loss(PolicyLoss.CISPO)
def cispo_loss(x: RatioInputs, *, clip_low: Bound | None = None, clip_high: Bound = 4.0) -> TokenLoss:
    """CISPO clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t l_t: every token keeps a gradient
    (weight times d log pi). The paper leaves the floor off (``clip_low=None``) and tunes only
    the cap; its value is unpublished, so the default cap 1 + 4 = 5 follows ScaleRL
    (arXiv 2510.13786), as TRL recommends. Paper aggregation: token-mean.
    """
    if clip_low is not None:
        _require("CISPO clip_low", clip_low, lambda v: (v >= 0) & (v <= 1), "None or in [0, 1]")
    _require("CISPO clip_high", clip_high, lambda v: v >= 0, ">= 0")
    ratio = x.ratio
    as_bound = functools.partial(torch.as_tensor, dtype=ratio.dtype, device=ratio.device)
    low = None if clip_low is None else as_bound(1.0 - clip_low)
    high = as_bound(1.0 + clip_high)
    weight = torch.clamp(ratio.detach(), min=low, max=high)
    loss = -weight * x.advantages * x.log_probs
    clipped_high = ratio > high
    clipped_low = ratio < low if low is not None else torch.zeros_like(clipped_high)
    return TokenLoss(loss, ratio, clipped_low, clipped_high)


@register_ratio_loss(PolicyLoss.IGPO_SEQUENCE)
def igpo_sequence_loss(
    x: RatioInputs, *, clip_low: Bound = 0.2, clip_high: Bound = 0.2, ratio_mask: Tensor | None = None
) -> TokenLoss:
    """Sequence-ratio PPO clip, differentiated through the sequence ratio (IGPO, arXiv 2509.10396,
    ``use_gspo`` in ``trainer_igpo.py``).

    s_i = exp(mean of (l_t - l_old_t) over ``ratio_mask``); per-token loss
    -min(s_i A_t, clip(s_i, 1 - clip_low, 1 + clip_high) A_t) reduced over the loss ``mask``, with
    the gradient taken through s_i: it reaches every ``ratio_mask`` position, also those outside
    the loss mask (unlike ``gspo``, whose ratio is a mean over the loss mask with per-token
    gradients). ``ratio_mask`` None = the loss mask; IGPO's official run uses all positions
    (``torch.ones_like``) with an entropy-filtered loss mask. Official clip 0.2 / 0.2, no dual clip.
    """
    check_clip_range(clip_low, clip_high)
    over = x.mask if ratio_mask is None else ratio_mask.detach().to(x.log_ratio.dtype).expand_as(x.log_ratio)
    seq_ratio = torch.exp(masked_mean(x.log_ratio, over, dim=-1)).unsqueeze(-1).expand_as(x.log_probs)
    return ppo_clip(seq_ratio, x.advantages, 1.0 - clip_low, 1.0 + clip_high)
