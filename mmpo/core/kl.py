"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3).

k1 = l - l_ref; k2 = 0.5 (l - l_ref)^2; k3 = exp(l_ref - l) - (l_ref - l) - 1
(the low-variance, always non-negative estimator used by GRPO, arXiv 2402.03300, and verl's
``low_var_kl``). k3 clamps its inner difference and its result, as verl does, so a single
wildly off-policy token cannot blow up the loss.

verl's names are accepted too (``kl_penalty_forward`` in verl's ``core_algos.py``): ``kl`` = k1,
``mse`` = k2, ``low_var_kl`` = k3 with the same clamps, and ``abs`` = |l - l_ref|; with a
trailing ``+`` the value is kept and the gradient is k2's (straight-through, verl's intent).
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor


class KLKind(str, Enum):
    """Valid KL estimator names."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    KL = "kl"  # verl's alias of k1
    ABS = "abs"  # verl: |l - l_ref|
    MSE = "mse"  # verl's alias of k2
    LOW_VAR_KL = "low_var_kl"  # verl's alias of k3 (same clamps)
    # straight-through: the value of the estimator, the gradient of k2 (verl's intent for "<name>+")
    K1_PLUS = "k1+"
    KL_PLUS = "kl+"
    ABS_PLUS = "abs+"
    K3_PLUS = "k3+"
    LOW_VAR_KL_PLUS = "low_var_kl+"


KL_KINDS: tuple[str, ...] = tuple(k.value for k in KLKind)
#: one line per kind (``mmpo list kl``)
KL_KIND_DESCRIPTIONS: dict[str, str] = {
    "k1": "l - l_ref (unbiased, high variance)",
    "k2": "0.5 (l - l_ref)^2",
    "k3": "exp(l_ref - l) - (l_ref - l) - 1 (GRPO's low-variance, non-negative estimator; clamped as verl)",
    "kl": "verl's alias of k1",
    "abs": "|l - l_ref| (verl)",
    "mse": "verl's alias of k2",
    "low_var_kl": "verl's alias of k3 (same clamps)",
    "k1+": "k1's value with k2's gradient (straight-through)",
    "kl+": "kl's value with k2's gradient (straight-through)",
    "abs+": "abs's value with k2's gradient (straight-through)",
    "k3+": "k3's value with k2's gradient (straight-through)",
    "low_var_kl+": "low_var_kl's value with k2's gradient (straight-through)",
}
_ALIASES = {KLKind.KL.value: KLKind.K1.value, KLKind.MSE.value: KLKind.K2.value, KLKind.LOW_VAR_KL.value: KLKind.K3.value}


def kl_penalty(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    kind: str | KLKind = "k3",
    *,
    inner_clamp: float = 20.0,
    output_clamp: float = 10.0,
) -> Tensor:
    """Elementwise KL estimate of pi_theta against pi_ref.

    Args:
        log_probs: ``(batch, time)`` log pi_theta of the sampled tokens.
        ref_log_probs: ``(batch, time)`` log pi_ref of the same tokens.
        kind: ``k1``, ``k2``, ``k3``, ``abs``, or verl's aliases ``kl`` (k1), ``mse`` (k2),
            ``low_var_kl`` (k3). A trailing ``+`` (``k1+``, ``kl+``, ``abs+``, ``k3+``,
            ``low_var_kl+``) keeps the value and takes the gradient of k2, 0.5 (l - l_ref)^2,
            whose expected gradient is the KL's (verl's straight-through names, which raise
            NotImplementedError in verl at b178a3cd).
        inner_clamp: k3 only: l_ref - l is clamped to [-inner_clamp, inner_clamp].
        output_clamp: k3 only: the result is clamped to [-output_clamp, output_clamp].

    Returns:
        ``(batch, time)`` per-token KL estimates (mask them yourself, e.g. with ``aggregate``).
    """
    value = kind.value if isinstance(kind, KLKind) else kind
    if value not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {list(KL_KINDS)}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != ref_log_probs shape {tuple(ref_log_probs.shape)}"
        )
    straight_through = value.endswith("+")
    base = value.removesuffix("+")
    base = _ALIASES.get(base, base)
    diff = log_probs - ref_log_probs
    if base == KLKind.ABS.value:
        estimate = diff.abs()
    elif base == KLKind.K1.value:
        estimate = diff
    elif base == KLKind.K2.value:
        estimate = 0.5 * diff.square()
    else:  # k3
        ref_minus = torch.clamp(ref_log_probs - log_probs, min=-inner_clamp, max=inner_clamp)
        estimate = torch.clamp(torch.exp(ref_minus) - ref_minus - 1.0, min=-output_clamp, max=output_clamp)
    if not straight_through:
        return estimate
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + estimate.detach()
