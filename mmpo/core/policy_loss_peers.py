"""Policy losses that verl (``core_algos.py``, commit b178a3cd) and TRL 1.16 (``GRPOTrainer``) ship,
written as ratio rules (:func:`~mmpo.core.policy_loss.register_ratio_loss`).

- ``sapo`` (verl + TRL; arXiv 2511.20347): a sigmoid gate instead of the hard clip.
- ``gpg`` (verl; arXiv 2504.02546): plain policy gradient -A log pi, no ratio, no clip.
- ``clip_cov`` / ``kl_cov`` (verl; arXiv 2505.22617): covariance-selected tokens lose their gradient
  (Clip-Cov) or get a |log r| penalty (KL-Cov), to keep the policy's entropy from collapsing.
- ``luspo`` (TRL; arXiv 2602.05261): GSPO with each sequence's loss scaled by its length.
- ``vespo`` (TRL; arXiv 2602.10693): a Gamma-shaped weight of the sequence ratio times -A log pi.

Unlike verl, every loss honours the aggregation mode it is given (verl's SAPO always uses
``seq-mean-token-mean``: pass ``agg="seq-mean-token-mean"`` to reproduce it). ``clip_cov`` and
``kl_cov`` select tokens from statistics of the batch they see, as verl does per micro-batch:
their micro-batch losses do not add up to the full-batch loss (:data:`BATCH_COUPLED_LOSSES`).
The parity with the peers' own functions is measured by ``bench/parity_peer_losses.py``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmpo.core.masked import masked_mean
from mmpo.core.policy_loss import (
    Bound,
    PolicyLoss,
    RatioInputs,
    TokenLoss,
    _require,
    check_clip_range,
    gspo_token_ratio,
    ppo_clip,
    register_ratio_loss,
)

# losses whose token selection depends on the whole batch they are given (see the module docstring)
# HAPO (mmpo.core.hapo) normalises entropies by the statistics of the batch it is given, as the official code
BATCH_COUPLED_LOSSES: frozenset[str] = frozenset(
    {PolicyLoss.CLIP_COV.value, PolicyLoss.KL_COV.value, PolicyLoss.HAPO.value})

# VESPO's floor on the sequence log-weight: log(1e-8), as TRL (matching the official code)
_VESPO_LOG_W_MIN = math.log(1e-8)


def _never(like: Tensor) -> Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


@register_ratio_loss(PolicyLoss.SAPO)
def sapo_loss(x: RatioInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> TokenLoss:
    """SAPO soft adaptive policy optimisation (arXiv 2511.20347; verl ``sapo``, TRL ``loss_type="sapo"``).

    loss_t = -f(r_t) A_t with the gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = ``tau_pos`` where
    A > 0, else ``tau_neg``. f(1) = 2 / tau and f'(1) = 1, so on-policy the gradient is the plain
    policy gradient; far from r = 1 it decays smoothly instead of being cut. Defaults 1.0 / 1.05
    (paper, Qwen3-30B-A3B; verl and TRL). Paper and both peers aggregate with
    ``seq-mean-token-mean``; verl forces it whatever ``loss_agg_mode`` says, here ``agg`` decides.
    """
    _require("SAPO temperatures tau_pos / tau_neg", (tau_pos, tau_neg), lambda v: v > 0, "> 0")
    ratio, advantages = x.ratio, x.advantages
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(-gate * advantages, ratio, _never(ratio), _never(ratio))


@register_ratio_loss(PolicyLoss.GPG)
def gpg_loss(x: RatioInputs) -> TokenLoss:
    """GPG group policy gradient loss (arXiv 2504.02546; verl ``gpg``): loss_t = -A_t l_t.

    No ratio, no clip, no old policy (the ratio metrics still report r). GPG's correction of the
    advantage is the ``gpg`` advantage estimator's job, not the loss's. Paper aggregation: token-mean.
    """
    return TokenLoss(-x.advantages * x.log_probs, x.ratio, _never(x.ratio), _never(x.ratio))


def _centred_covariance(x: RatioInputs) -> Tensor:
    """(A_t - mean A)(l_t - mean l) per token, means over the mask; detached (it only selects tokens)."""
    log_probs = x.log_probs.detach()
    return (x.advantages - masked_mean(x.advantages, x.mask)) * (log_probs - masked_mean(log_probs, x.mask))


@register_ratio_loss(PolicyLoss.CLIP_COV)
def clip_cov_loss(
    x: RatioInputs,
    *,
    clip_low: Bound = 0.2,
    clip_high: Bound = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> TokenLoss:
    """Clip-Cov (arXiv 2505.22617; verl ``clip_cov``): PPO clip, and a few high-covariance tokens
    lose their loss and gradient.

    cov_t = (A_t - mean A)(l_t - mean l) over the batch's real tokens. Among the real tokens the
    PPO clip leaves alone with ``clip_cov_lb`` < cov_t < ``clip_cov_ub``, max(1, int(``clip_cov_ratio``
    x real tokens)) are drawn at random (``torch.randperm`` with ``generator``; None = torch's global
    generator, as verl) and their loss is set to 0. Defaults: verl's config (ratio 2e-4, bounds
    1 / 5, clip 0.2 / 0.2). Logged: ``policy/clipfrac_cov`` (the dropped tokens).
    """
    check_clip_range(clip_low, clip_high)
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    clipped = ppo_clip(x.ratio, x.advantages, 1.0 - clip_low, 1.0 + clip_high)
    valid = x.mask > 0
    with torch.no_grad():
        cov = _centred_covariance(x)
        candidates = valid & ~(clipped.clipped_low | clipped.clipped_high) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        positions = torch.nonzero(candidates)  # (n, 2), row-major like verl
        budget = max(int(clip_cov_ratio * int(valid.sum())), 1)
        dropped = torch.zeros_like(valid)
        if len(positions) > 0:
            chosen = positions[torch.randperm(len(positions), generator=generator)[:budget].to(positions.device)]
            dropped[chosen[:, 0], chosen[:, 1]] = True
    loss = torch.where(dropped, torch.zeros_like(clipped.loss), clipped.loss)
    return TokenLoss(loss, x.ratio, clipped.clipped_low, clipped.clipped_high, flags={"clipfrac_cov": dropped})


@register_ratio_loss(PolicyLoss.KL_COV)
def kl_cov_loss(x: RatioInputs, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1) -> TokenLoss:
    """KL-Cov (arXiv 2505.22617; verl ``kl_cov``): unclipped -r A, plus ``ppo_kl_coef`` |log r| on
    the highest-covariance tokens.

    cov_t as in ``clip_cov``; the max(1, int(``kl_cov_ratio`` x real tokens)) real tokens of largest
    cov_t (``torch.topk``) get loss -r A + coef |l - l_old|, the others -r A. No clip. Defaults:
    verl's config (ratio 2e-4, coef 0.1; verl's function falls back to coef 1.0 without a
    config). Logged: ``policy/kl_cov_frac`` (the penalised tokens).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    if ppo_kl_coef < 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    valid = x.mask > 0
    with torch.no_grad():
        flat_valid = torch.nonzero(valid.reshape(-1)).flatten()
        penalised = torch.zeros_like(valid)
        if len(flat_valid) > 0:
            # top-k over the real tokens in row-major order, as verl (same tie order)
            cov = _centred_covariance(x).reshape(-1)[flat_valid]
            count = max(1, int(len(flat_valid) * kl_cov_ratio))
            penalised.view(-1)[flat_valid[torch.topk(cov, count, largest=True).indices]] = True
    base = -x.advantages * x.ratio
    loss = torch.where(penalised, base + ppo_kl_coef * x.log_ratio.abs(), base)
    return TokenLoss(loss, x.ratio, _never(x.ratio), _never(x.ratio), flags={"kl_cov_frac": penalised})


@register_ratio_loss(PolicyLoss.LUSPO)
def luspo_loss(x: RatioInputs, *, clip_low: Bound = 2e-3, clip_high: Bound = 2.5e-3) -> TokenLoss:
    """LUSPO length-unbiased sequence policy optimisation (arXiv 2602.05261; TRL ``loss_type="luspo"``).

    GSPO's clipped sequence loss (the ``gspo`` rule: -min(s A, clip(s, 1 - clip_low, 1 + clip_high) A),
    s = exp(mean_t (l - l_old))) scaled by the sequence length |o_i| and put on each of its tokens,
    so ``seq-mean-token-mean`` gives the paper's (1/G) sum_i |o_i| l_i (= TRL's
    ``(per_token_loss * mask).sum(-1).mean()``); other modes re-weight sequences. Defaults 2e-3 /
    2.5e-3 (paper section 5.1, TRL's recommended setting). Recommended: ``agg="seq-mean-token-mean"``.
    """
    check_clip_range(clip_low, clip_high)
    clipped = ppo_clip(gspo_token_ratio(x), x.advantages, 1.0 - clip_low, 1.0 + clip_high)
    length = x.mask.sum(dim=-1, keepdim=True)
    return TokenLoss(clipped.loss * length, clipped.ratio, clipped.clipped_low, clipped.clipped_high)


@register_ratio_loss(PolicyLoss.VESPO)
def vespo_loss(
    x: RatioInputs,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> TokenLoss:
    """VESPO variational sequence-level soft policy optimisation (arXiv 2602.10693; TRL ``loss_type="vespo"``).

    W_i = exp(clamp(sum_t (l_t - l_old_t), log 1e-8, 20)) (the sequence ratio: a sum, not a mean);
    phi(W) = W^k exp(lambda (1 - W)) (phi(1) = 1), detached, with (k, lambda) = (``k_pos``,
    ``lambda_pos``) where A >= 0, else (``k_neg``, ``lambda_neg``); loss_t = -phi A_t l_t (the
    gradient is phi A d log pi). Defaults 2 / 3 / 3 / 2 (paper section 3.4, TRL). TRL aggregates
    over tokens (``token-mean``). TRL's extra factor from vLLM's token IS ratios is not included.
    """
    _require("VESPO k_pos / k_neg", (k_pos, k_neg), lambda v: v >= 0, ">= 0")
    _require("VESPO lambda_pos / lambda_neg", (lambda_pos, lambda_neg), lambda v: v > 0, "> 0")
    with torch.no_grad():
        seq_log_w = (x.log_ratio * x.mask).sum(dim=-1, keepdim=True)
        log_w = torch.clamp(seq_log_w, min=_VESPO_LOG_W_MIN, max=20.0)
        w = torch.exp(log_w)
        nonneg = x.advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(w.dtype)
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * x.advantages * x.log_probs
    return TokenLoss(loss, w.expand_as(x.log_probs), _never(x.ratio), _never(x.ratio))
