"""Pairwise preference losses on sequence log-probs: the DPO family and INPO.

Every loss takes per-pair SEQUENCE log-probs (the sum of a completion's token log-probs), so
any policy that can score a completion feeds it: the VLM's chunked path
(``mmpo.vlm.logprobs.completion_log_probs``), the masked-diffusion LM's estimator
(``mmpo.dllm.logprobs.completion_log_probs``), or a test's hand numbers.

DPO family (``preference_loss``; Delta = (l_w - l_w^ref) - (l_l - l_l^ref), one value per pair):

- ``sigmoid``  DPO (arXiv 2305.18290, Eq. 7) with cDPO label smoothing eps (Mitchell 2023):
  -(1 - eps) log sigma(beta Delta) - eps log sigma(-beta Delta); eps = 0 is DPO.
- ``ipo``      IPO (arXiv 2310.12036, Eq. 17): (Delta - 1 / (2 beta))^2. ``length_normalize``
  divides each completion's log-ratio by its token count first (TRL's choice, confirmed with
  the IPO authors per TRL's comment; the paper's formula is unnormalised, our default).
- ``robust``   robust DPO (arXiv 2403.00409, Eq. 7): [-(1 - eps) log sigma(beta Delta)
  + eps log sigma(-beta Delta)] / (1 - 2 eps), unbiased under label-flip rate eps < 0.5.
- ``hinge``    SLiC-HF (arXiv 2305.10425): relu(1 - beta Delta).

RPO (``rpo_alpha``; Pang et al., "Iterative Reasoning Preference Optimization", arXiv 2404.19733):
any of the above plus rpo_alpha x the chosen completions' NLL, a token mean over every chosen token
of the batch, -sum_i l_w,i / sum_i |y_w,i| (``chosen_nll``). That is TRL 1.16.0's
``loss_type=["sigmoid", "sft"], loss_weights=[1.0, rpo_alpha]`` (earlier TRL releases: ``rpo_alpha``);
the paper uses 1.0.

INPO (``inpo_loss``; Zhang et al., "Iterative Nash Policy Optimization", arXiv 2407.00617): the
online-mirror-descent step pi_{t+1} ~ pi_t^(1 - eta tau) pi_ref^(eta tau) exp(eta P(y > pi_t)) is
fitted by the square loss on a preferred / dispreferred pair (y_w, y_l) sampled from pi_t:

    h = log pi(y_w)/pi(y_l) - eta tau log pi_ref(y_w)/pi_ref(y_l) - (1 - eta tau) log pi_t(y_w)/pi_t(y_l)
    loss = (h - eta / 2)^2

with eta the mirror-descent learning rate and tau the KL regularisation towards pi_ref. With
eta tau = 1 the previous iterate drops out and INPO is online IPO with beta = 1 / eta.

Metrics (TRL's names): ``rewards/chosen`` / ``rewards/rejected`` = the implicit rewards
beta (l - l_anchor) averaged over pairs, ``rewards/margins`` their difference,
``rewards/accuracies`` the fraction of pairs with chosen > rejected (strictly), plus
``logps/chosen`` / ``logps/rejected``, ``losses/preference`` (the DPO-family term) and, when the
chosen lengths are given, ``losses/sft`` (the chosen NLL, logged whether or not ``rpo_alpha`` weights it). For INPO the anchor is the
geometric mixture eta tau log pi_ref + (1 - eta tau) log pi_t and the scale is 1, so
``rewards/margins`` is the mean of h, the quantity regressed onto eta / 2.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mmpo.core.loss_parts import LossParts
from mmpo.core.registry import Registry


class PreferenceLossName(str, Enum):
    """Built-in DPO-family loss names."""

    SIGMOID = "sigmoid"
    IPO = "ipo"
    ROBUST = "robust"
    HINGE = "hinge"


#: (delta (P,), beta, label_smoothing) -> per-pair loss (P,)
PairLoss = Callable[[Tensor, float, float], Tensor]
PREFERENCE_LOSSES: Registry[PairLoss] = Registry("preference loss")


@PREFERENCE_LOSSES.register(PreferenceLossName.SIGMOID)
def _sigmoid(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)


@PREFERENCE_LOSSES.register(PreferenceLossName.IPO)
def _ipo(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (delta - 1 / (2 * beta)) ** 2


@PREFERENCE_LOSSES.register(PreferenceLossName.ROBUST)
def _robust(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
    flipped = -label_smoothing * F.logsigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * label_smoothing)


@PREFERENCE_LOSSES.register(PreferenceLossName.HINGE)
def _hinge(delta: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return torch.relu(1 - beta * delta)


def check_preference_settings(name: str, beta: float, label_smoothing: float = 0.0) -> None:
    """Raise ValueError (naming the valid values) for an unknown loss or out-of-range settings."""
    PREFERENCE_LOSSES.get(name)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    upper = 0.5 if name == PreferenceLossName.ROBUST.value else 1.0
    if not 0.0 <= label_smoothing < upper:
        raise ValueError(f"label_smoothing must be in [0, {upper}) for loss {name!r}, got {label_smoothing}")
    if label_smoothing and name not in (PreferenceLossName.SIGMOID.value, PreferenceLossName.ROBUST.value):
        raise ValueError(f"label_smoothing applies to 'sigmoid' and 'robust' only, not {name!r}")


def _check_pairs(*tensors: Tensor | None) -> None:
    shapes = {tuple(t.shape) for t in tensors if t is not None}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"preference losses take (pairs,) sequence log-probs of one shape, got shapes {sorted(shapes)}")


def implicit_reward_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, float]:
    """``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (pair means)."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": float(chosen_rewards.mean()),
        "rewards/rejected": float(rejected_rewards.mean()),
        "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
        "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
    }


def chosen_nll(chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """Token-mean NLL of the chosen completions over the whole batch: -sum(l_w) / sum(|y_w|).

    The same value as TRL 1.16.0's ``sft`` loss type, ``-chosen_per_token_logps[chosen_mask].mean()``,
    from the sequence log-probs and token counts (0 when the batch has no chosen token).
    """
    _check_pairs(chosen_logps, chosen_lengths)
    return -chosen_logps.sum() / chosen_lengths.to(chosen_logps).sum().clamp(min=1.0)


def preference_loss(
    name: str,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    length_normalize: bool = False,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    rpo_alpha: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Mean DPO-family loss over pairs (plus RPO's chosen NLL), and its metrics.

    Args:
        name: ``sigmoid`` (DPO / cDPO), ``ipo``, ``robust``, ``hinge`` (:data:`PREFERENCE_LOSSES`).
        chosen_logps: (P,) log pi_theta(y_w | x), summed over the completion's tokens.
        rejected_logps: (P,) log pi_theta(y_l | x).
        ref_chosen_logps: (P,) log pi_ref(y_w | x) (no gradient needed).
        ref_rejected_logps: (P,) log pi_ref(y_l | x).
        beta: the KL strength beta (IPO: its tau; the target margin is 1 / (2 beta)).
        label_smoothing: eps, the assumed label-flip rate (sigmoid: cDPO; robust: < 0.5).
        length_normalize: ``ipo`` only: divide each log-ratio by its completion's token count
            (TRL's IPO); needs ``chosen_lengths`` / ``rejected_lengths`` (P,).
        rpo_alpha: weight of the chosen completions' token-mean NLL (:func:`chosen_nll`, needs
            ``chosen_lengths``) added to the loss; 0 = the DPO-family loss alone.

    Returns:
        ``(loss, metrics)``: the 0-d mean over pairs (+ rpo_alpha x NLL) and the metrics in the
        module docstring.
    """
    check_preference_settings(name, beta, label_smoothing)
    if not rpo_alpha >= 0:
        raise ValueError(f"rpo_alpha must be >= 0, got {rpo_alpha}")
    if rpo_alpha and chosen_lengths is None:
        raise ValueError("rpo_alpha weights the chosen completions' token-mean NLL; it needs chosen_lengths")
    _check_pairs(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths)
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if length_normalize:
        if name != PreferenceLossName.IPO.value:
            raise ValueError(f"length_normalize is TRL's IPO normalisation; it does not apply to {name!r}")
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("length_normalize needs chosen_lengths and rejected_lengths (tokens per completion)")
        delta = (chosen_ratio / chosen_lengths.to(chosen_ratio).clamp(min=1.0)
                 - rejected_ratio / rejected_lengths.to(rejected_ratio).clamp(min=1.0))
    else:
        delta = chosen_ratio - rejected_ratio
    parts = LossParts().add("preference", PREFERENCE_LOSSES.get(name)(delta, beta, label_smoothing).mean())
    if chosen_lengths is not None:
        parts.add("sft", chosen_nll(chosen_logps, chosen_lengths), coef=rpo_alpha)
    metrics = implicit_reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
    metrics.update({"logps/chosen": float(chosen_logps.detach().mean()),
                    "logps/rejected": float(rejected_logps.detach().mean()),
                    **{key: float(value) for key, value in parts.metrics().items()}})
    return parts.total(), metrics


def check_inpo_settings(eta: float, tau: float) -> None:
    """eta > 0 and 0 <= eta * tau <= 1 (the mixture weights of pi_ref and pi_t are eta tau and 1 - eta tau)."""
    if not eta > 0:
        raise ValueError(f"eta (INPO's learning rate) must be > 0, got {eta}")
    if not (tau >= 0 and eta * tau <= 1):
        raise ValueError(f"INPO needs tau >= 0 and eta * tau <= 1 (weights of pi_ref and pi_t), got eta={eta}, tau={tau}")


def inpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    prev_chosen_logps: Tensor,
    prev_rejected_logps: Tensor,
    *,
    eta: float,
    tau: float,
) -> tuple[Tensor, dict[str, float]]:
    """INPO's square loss (arXiv 2407.00617), mean over pairs sampled from the previous iterate pi_t.

    Args:
        chosen_logps, rejected_logps: (P,) sequence log-probs under the policy being trained.
        ref_chosen_logps, ref_rejected_logps: (P,) under the reference pi_ref (the KL anchor).
        prev_chosen_logps, prev_rejected_logps: (P,) under the previous iterate pi_t (the
            mirror-descent anchor; the policy that sampled the pairs).
        eta: mirror-descent learning rate (the regression target is eta / 2).
        tau: KL regularisation coefficient towards pi_ref (weight eta tau; needs eta tau <= 1).

    Returns:
        ``(loss, metrics)``: mean of (h - eta / 2)^2 and the metrics in the module docstring.
    """
    check_inpo_settings(eta, tau)
    _check_pairs(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, prev_chosen_logps,
                 prev_rejected_logps)
    weight_ref = eta * tau
    anchor_chosen = weight_ref * ref_chosen_logps + (1 - weight_ref) * prev_chosen_logps
    anchor_rejected = weight_ref * ref_rejected_logps + (1 - weight_ref) * prev_rejected_logps
    chosen_reward = chosen_logps - anchor_chosen
    rejected_reward = rejected_logps - anchor_rejected
    h = chosen_reward - rejected_reward
    loss = ((h - eta / 2) ** 2).mean()
    metrics = implicit_reward_metrics(chosen_reward, rejected_reward)
    metrics.update({"logps/chosen": float(chosen_logps.detach().mean()),
                    "logps/rejected": float(rejected_logps.detach().mean()),
                    "losses/preference": float(loss.detach())})
    return loss, metrics
