"""T-PPO's extended GAE (Truncated PPO, arXiv 2506.15050) on token sequences.

Generation runs in windows, so when the update runs some responses are complete and some are cut
after l tokens. Extended GAE runs GAE over the generated tokens of either kind:
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = sum_k (gamma lam)^k delta_{t+k},
with r_t = 0 before the end. A completed response ends in its terminal reward (no bootstrap); a
truncated one bootstraps V(s_l), the critic's value of the state after its last generated token.
This is :func:`mmpo.core.gae` with the end of each row marked ``terminated`` or ``truncated``.

No official code was found; the EGAE details, window length, gamma and lambda are UNVERIFIED
(docs/algorithm_sources.md section 14, T-PPO). Defaults gamma = lam = 1.0 are verl's PPO defaults, not the paper's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmpo.core.advantages import AdvantageEstimator, Metrics, gae, register_advantage_estimator
from mmpo.core.advantages_verl import _check_per_sample, _check_per_token
from mmpo.core.groups import GroupIndex


def truncated_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    completed: Tensor,
    bootstrap_values: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Extended GAE over ``(N, T)`` token sequences; returns (advantages, returns), 0 off the mask.

    Args:
        rewards: ``(N,)`` terminal reward of completed rows (ignored for truncated rows).
        values: ``(N, T)`` critic value V(s_t) before each generated token.
        mask: ``(N, T)`` 1 on generated tokens (contiguous from 0).
        completed: ``(N,)`` bool: the row ended (EOS) inside this window.
        bootstrap_values: ``(N,)`` V(s_l) after a truncated row's last token (ignored when completed).
        gamma: discount.
        lam: GAE lambda.
    """
    mask = mask.to(values.dtype)
    completed = completed.to(device=values.device).bool()
    lengths = mask.sum(-1).long()
    n, width = values.shape
    positions = torch.arange(width, device=values.device).expand(n, width)
    last = (positions == (lengths - 1).unsqueeze(1)) & (lengths > 0).unsqueeze(1)
    values = values * mask
    # next value: V(s_{t+1}) inside the row, the bootstrap after a truncated row's last token
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    next_values = torch.where(last, bootstrap_values.to(values).unsqueeze(1).expand(n, width), next_values)
    terminated = last & completed.unsqueeze(1)
    token_rewards = torch.where(terminated, rewards.to(values).unsqueeze(1).expand(n, width), torch.zeros_like(values))
    truncated = (last & ~completed.unsqueeze(1)) | (mask == 0)
    advantages, returns = gae(token_rewards.T, values.T, next_values.T, terminated.T, truncated.T, gamma=gamma, lam=lam)
    return advantages.T * mask, returns.T * mask


@register_advantage_estimator(AdvantageEstimator.TPPO)
def tppo_advantages(
    rewards: Tensor,
    index: GroupIndex,
    *,
    mask: Tensor,
    values: Tensor,
    completed: Tensor,
    bootstrap_values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Metrics]:
    """T-PPO advantages ``(N, T)``: :func:`truncated_gae` (critic-based; the prompt groups play no part).

    Args:
        rewards: ``(N,)`` terminal rewards (used for completed rows).
        index: prompt groups (unused: the critic is the baseline).
        mask: ``(N, T)`` the window's generated tokens.
        values: ``(N, T)`` critic values.
        completed: ``(N,)`` bool, the row ended in this window.
        bootstrap_values: ``(N,)`` critic value after a truncated row's last token.
        gamma: discount (UNVERIFIED; verl's default 1.0).
        lam: GAE lambda (UNVERIFIED; verl's default 1.0).
    """
    del index
    mask = _check_per_token("mask", mask, rewards)
    values = _check_per_token("values", values, rewards)
    bootstrap_values = _check_per_sample("bootstrap_values", bootstrap_values, rewards)
    if completed.shape != rewards.shape:
        raise ValueError(f"completed must be (N,) = {tuple(rewards.shape)}, got {tuple(completed.shape)}")
    advantages, _ = truncated_gae(rewards, values, mask, completed, bootstrap_values, gamma=gamma, lam=lam)
    return advantages, {"advantages/truncated_frac": float((~completed.bool()).float().mean())}
