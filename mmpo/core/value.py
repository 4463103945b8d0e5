"""PPO with a learned critic on token sequences: token-level rewards, token GAE and the clipped value loss.

- :func:`outcome_token_rewards`: the outcome reward of each completion at its last real token, minus
  ``kl_coef x KL(pi_old || pi_ref)`` on every token when the KL is in the reward (classic RLHF PPO; verl's
  ``apply_kl_penalty`` in ``verl/trainer/ppo/ray_trainer.py``, TRL's ``PPOTrainer``).
- :func:`token_gae`: GAE over the completion tokens (verl's ``compute_gae_advantage_return`` in
  ``verl/trainer/ppo/core_algos.py``, adapted from TRL's ``PPOTrainer``): masked tokens are skipped (the
  value and the running advantage carry over them), the last token bootstraps nothing. Unlike verl it does
  not whiten: :func:`mmpo.core.masked_whiten` does (PPO whitens, verl and TRL alike).
- :func:`value_loss`: ``0.5 x agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))`` (verl's
  ``compute_value_loss``, copied there from TRL's ``PPOTrainer``) and its clip fraction.

Pure torch; :mod:`mmpo.algos.ppo` calls them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmpo.core.aggregate import aggregate
from mmpo.core.kl import kl_penalty
from mmpo.core.masked import masked_mean


def _same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or next(iter(tensors.values())).ndim != 2:
        raise ValueError(f"expected equal (N, T) shapes, got {shapes}")


def last_token_index(mask: Tensor) -> Tensor:
    """``(N,)`` position of each row's last real token (-1 for an empty row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(-1)


def outcome_token_rewards(
    scores: Tensor,
    mask: Tensor,
    *,
    old_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """``(N, T)`` token rewards: ``scores[i]`` at row i's last real token, ``- kl_coef x KL_t`` on every real
    token when ``kl_coef > 0`` (KL of the rollout policy to the reference, ``kl_kind`` of
    :func:`mmpo.core.kl_penalty`; verl's default ``kl``, i.e. k1). Empty rows get nothing.

    Returns the rewards and ``{"ppo/kl_in_reward": token-mean KL}`` when the KL is used."""
    if scores.ndim != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be (N,) with N = {mask.shape[0]}, got {tuple(scores.shape)}")
    mask_f = mask.to(scores.dtype if scores.dtype.is_floating_point else torch.float32)
    rewards = torch.zeros_like(mask_f)
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    metrics: dict[str, float] = {}
    if kl_coef:
        if old_log_probs is None or ref_log_probs is None:
            raise ValueError("kl_coef > 0 needs old_log_probs and ref_log_probs")
        _same_shape(old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, mask=mask_f)
        kl = kl_penalty(old_log_probs.to(rewards.dtype), ref_log_probs.to(rewards.dtype), kl_kind) * mask_f
        rewards = rewards - kl_coef * kl
        metrics["ppo/kl_in_reward"] = float(masked_mean(kl, mask_f)) if bool(mask_f.any()) else 0.0
    return rewards, metrics


def token_gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """GAE over ``(N, T)`` completion tokens; returns ``(advantages, returns)``, not whitened.

    Walking t from the last token back, with V_next and A_next the value and advantage of the next real token
    (0 past the end)::

        delta_t = r_t + gamma V_next - V_t,  A_t = delta_t + gamma lam A_next   (real tokens)

    and on a masked token the recursion carries V_next and A_next over it unchanged (verl: observation tokens
    of a multi-turn rollout). ``returns = advantages + values`` (the critic's targets). gamma = lam = 1
    (verl's defaults) makes A_t the final reward minus V_t for an outcome reward.
    """
    _same_shape(token_rewards=token_rewards, values=values, mask=mask)
    dtype = values.dtype if values.dtype.is_floating_point else torch.float32
    rewards, values, mask_f = token_rewards.to(dtype), values.to(dtype), mask.to(dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * mask_f[:, t] + (1 - mask_f[:, t]) * next_value
        running = candidate * mask_f[:, t] + (1 - mask_f[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + values


def value_loss(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss ``0.5 x agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    ``values`` carry the gradient; ``returns`` and ``old_values`` (the critic's values at rollout time) are
    targets. ``clip`` None = no clipping (plain ``0.5 x agg((V - R)^2)``). verl's default ``cliprange_value``
    is 0.5 (``critic.cliprange_value``), TRL's ``cliprange_value`` 0.2.

    Returns the loss and ``value/clipfrac`` (share of real tokens where the clipped term is larger),
    ``value/vpred_mean``, ``value/error_mean`` (mean (V - R)^2) as floats.
    """
    _same_shape(values=values, returns=returns, old_values=old_values, mask=mask)
    returns, old_values = returns.detach().to(values.dtype), old_values.detach().to(values.dtype)
    losses = (values - returns) ** 2
    if clip is None:
        per_token = losses
        clipped_more = torch.zeros_like(losses)
    else:
        if clip <= 0:
            raise ValueError(f"value clip must be > 0 or None, got {clip}")
        clipped = torch.minimum(torch.maximum(values, old_values - clip), old_values + clip)
        losses_clipped = (clipped - returns) ** 2
        per_token = torch.maximum(losses, losses_clipped)
        clipped_more = (losses_clipped > losses).to(values.dtype)
    loss = 0.5 * aggregate(per_token, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                           norm_len=norm_len)
    mask_f = mask.to(values.dtype)
    with torch.no_grad():
        any_token = bool(mask_f.any())
        metrics = {
            "value/clipfrac": float(masked_mean(clipped_more, mask_f)) if any_token else 0.0,
            "value/vpred_mean": float(masked_mean(values.detach(), mask_f)) if any_token else 0.0,
            "value/error_mean": float(masked_mean(losses.detach(), mask_f)) if any_token else 0.0,
        }
    return loss, metrics
