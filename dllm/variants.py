"""GRPO-family variants on the masked-diffusion module, through DiffuGRPO's two hooks.

- :class:`LSPODiffuGRPO`: LSPO's length-band filter (arXiv 2510.01459, ``mmpo.core.lspo_filter``)
  after the zero-variance filter, on ``filter_groups``. A completion's length is its tokens before
  the first EOS (what ``decode_completions`` keeps), the whole ``gen_length`` when it has none.
- :class:`SFPODiffuGRPO`: SFPO's slow-fast update (arXiv 2510.04072, ``mmpo.core.slow_fast``) on
  ``update_policy``: K fast passes of the ``inner_updates`` steps, reposition, one slow pass; the old
  log-probs stay theta_0's. The entropy switch reads the token-mean entropy of theta_0 on the batch
  (the old-policy entropies this module computes anyway; the official code reads the update's
  entropy, which the dLLM loss does not compute).

See docs/variants/lspo.md and docs/variants/sfpo.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dllm.rl import DiffuGRPO
from mmpo.core import dynamic_sampling_filter, lspo_filter
from mmpo.core.slow_fast import EntropyZScoreSwitch, slow_fast_update
from mmpo.training.state_hooks import CheckpointedState


def completion_lengths(completions: Tensor, eos_token_id: int) -> Tensor:
    """(N,) tokens before each row's first EOS (the row's width when it has none)."""
    width = completions.shape[1]
    is_eos = completions == eos_token_id
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.full_like(completions[:, 0], width))
    return first.to(torch.float32)


class LSPODiffuGRPO(DiffuGRPO):
    """DiffuGRPO / IGPO with LSPO's length bands (defaults as ``mmpo.algos.lspo.LSPOModule``; UNVERIFIED).

    Args:
        lspo_low, lspo_high, lspo_max: the band quantiles (keep L <= Q(low) or Q(high) <= L <= Q(max)).
        lspo_zero_variance: run the zero-variance filter first (the paper's order).
        **kwargs: every :class:`~dllm.rl.DiffuGRPO` setting.
    """

    def __init__(self, *, lspo_low: float = 0.3, lspo_high: float = 0.65, lspo_max: float = 0.95,
                 lspo_zero_variance: bool = True, **kwargs: Any) -> None:
        if not 0.0 <= lspo_low <= lspo_high <= lspo_max <= 1.0:
            raise ValueError(f"LSPO needs 0 <= lspo_low <= lspo_high <= lspo_max <= 1, got "
                             f"{lspo_low}, {lspo_high}, {lspo_max}")
        super().__init__(**kwargs)

    def filter_groups(self, batch: dict) -> tuple[Tensor | None, dict[str, float]]:
        h = self.hparams
        rewards, group_ids = batch["rewards"], batch["group_ids"]
        metrics: dict[str, float] = {}
        candidates = None
        if h.lspo_zero_variance:
            zero_variance = dynamic_sampling_filter(rewards, group_ids)
            candidates = zero_variance.keep_mask
            metrics["rewards/dropped_groups"] = float(zero_variance.num_dropped)
        lengths = completion_lengths(batch["completions"], self.tokenizer.eos_token_id).to(rewards.device)
        kept = lspo_filter(lengths, group_ids, candidates, low=h.lspo_low, high=h.lspo_high, max_quantile=h.lspo_max)
        groups = group_ids.unique()
        metrics["lspo/dropped_groups"] = float(kept.num_dropped)
        metrics["lspo/kept_frac"] = float(group_ids[kept.keep_mask].unique().numel()) / groups.numel()
        return kept.keep_mask, metrics


class SFPODiffuGRPO(CheckpointedState, DiffuGRPO):
    """DiffuGRPO / IGPO whose update is SFPO's slow-fast update (official defaults K 3, alpha 0.8, W 30, z 1.0).

    Every pass makes ``inner_updates`` optimizer steps, so a batch makes (K + 1) x ``inner_updates``;
    ``trainer.max_steps`` counts all of them. The switch state is saved in checkpoints.
    """

    checkpointed_state = (("sfpo_switch", "sfpo_switch"),)

    def __init__(self, *, sfpo_inner_steps: int = 3, sfpo_alpha: float = 0.8, sfpo_zscore_window: int = 30,
                 sfpo_zscore_threshold: float = 1.0, **kwargs: Any) -> None:
        if sfpo_inner_steps < 1:
            raise ValueError(f"sfpo_inner_steps (K) must be >= 1, got {sfpo_inner_steps}")
        if not 0 < sfpo_alpha <= 1:
            raise ValueError(f"sfpo_alpha must be in (0, 1], got {sfpo_alpha}")
        super().__init__(**kwargs)
        self.sfpo_switch = EntropyZScoreSwitch(sfpo_zscore_window, sfpo_zscore_threshold)

    def update_policy(self, batch, keys, old, ref, advantages, loss_masks):
        h = self.hparams
        active = self.sfpo_switch.check()
        plain = super().update_policy

        def one_update():
            return plain(batch, keys, old, ref, advantages, loss_masks)

        if active:
            metrics, loss = slow_fast_update(self.model.parameters(), one_update, inner_steps=h.sfpo_inner_steps,
                                             alpha=h.sfpo_alpha)
        else:
            metrics, loss = one_update()
        entropies = [float((old[key][1] * mask).sum() / mask.sum().clamp_min(1)) for key, mask in loss_masks.items()]
        self.sfpo_switch.record(sum(entropies) / len(entropies))
        metrics["sfpo/active"] = float(active)
        if self.sfpo_switch.last_z == self.sfpo_switch.last_z:  # not NaN: W entropies were recorded
            metrics["sfpo/entropy_zscore"] = self.sfpo_switch.last_z
        return metrics, loss
