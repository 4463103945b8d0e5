"""AHPO: Adaptive Hybrid Policy Optimization (MM-HELIX, arXiv 2510.08540).

GRPO whose prompts may carry an expert trace y*. Per prompt:

1. Roll out G (5) completions and score them as usual.
2. Gate (Eq. 6): xi = 1 when fewer than R_hat (2) of the G rollouts have reward exactly 1.0,
   else 0 (:func:`expert_gate`). Prompts without an expert trace never open the gate (plain
   GRPO). ``static=True`` is "Static-AHPO" (xi = 1 whenever a trace exists).
3. Loss (Eq. 5): L = [ -sum_{gated y*} sum_t log pi(y*_t | x, y*_<t) + sum_on sum_t CLIP_t ] / Z
   with Z = on-policy tokens + gated expert tokens: one token-mean over the union of both
   parts (:func:`hybrid_loss`). The expert NLL is plain SFT (no ratio, no clipping) and the
   trace is not part of the advantage group. No reference KL by default.

Sources: paper section 3.3, App. A.2 (the training code is unreleased; Z follows the LUFFY-style
reading, see ``docs/algorithm_sources.md`` section 5).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import LossConfig, SamplingConfig, as_config
from mmpo.core import LossParts
from mmpo.core.groups import build_group_index
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.processing import encode_completions, encode_prompts
from mmpo.vlm.rollout import Rollout


def expert_gate(
    rewards: Tensor,
    group_ids: Tensor,
    has_trace: Tensor,
    *,
    min_successes: int = 2,
    success_value: float = 1.0,
    static: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-prompt gate xi (MM-HELIX, arXiv 2510.08540, Eq. 6).

    Args:
        rewards: ``(N,)`` rollout rewards.
        group_ids: ``(N,)`` prompt id per rollout (any order).
        has_trace: ``(N,)`` bool, the rollout's prompt carries an expert trace.
        min_successes: R_hat; the gate opens when #(reward == success_value) < R_hat.
        success_value: the reward of a fully correct rollout (exact equality, as the paper's 1[R = 1]).
        static: Static-AHPO: the gate is open for every prompt with a trace.

    Returns:
        ``(group_ids_sorted (P,), gate (P,) bool)`` for the P distinct prompts, ids ascending.
    """
    index = build_group_index(group_ids, num_samples=rewards.numel(), min_size=1)
    successes = index.sum((rewards == success_value).to(torch.float32))
    trace = index.amax(has_trace.to(torch.float32)) > 0
    if static:
        gate = trace
    else:
        gate = trace & (successes < min_successes)
    return index.ids, gate


def hybrid_loss(
    on_policy_token_loss: Tensor,
    on_policy_mask: Tensor,
    expert_log_probs: Tensor,
    expert_mask: Tensor,
    expert_gate: Tensor,
    *,
    total_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AHPO's loss over the union of on- and off-policy tokens (arXiv 2510.08540, Eq. 5).

    L = [ sum(on_policy_token_loss * on_mask) + sum(-expert_log_probs * expert_mask * xi) ] / Z,
    Z = sum(on_mask) + sum(expert_mask * xi).

    Args:
        on_policy_token_loss: ``(N, T)`` per-token clipped-surrogate loss of the rollouts.
        on_policy_mask: ``(N, T)`` real rollout tokens.
        expert_log_probs: ``(P, Te)`` log pi(y*_t | x, y*_<t) of the expert traces (with grad).
        expert_mask: ``(P, Te)`` real expert tokens.
        expert_gate: ``(P,)`` xi per trace (bool or 0/1).
        total_tokens: Z over the whole batch when this call sees one micro-batch (gradient
            accumulation); default: this call's own Z.

    Returns:
        ``(loss 0-d, metrics)`` with ``ahpo/off_policy_token_share`` (gated expert tokens / Z).
    """
    on_mask = on_policy_mask.to(on_policy_token_loss.dtype)
    gate = expert_gate.to(expert_log_probs.dtype)[:, None]
    off_mask = expert_mask.to(expert_log_probs.dtype) * gate
    on_tokens = on_mask.sum()
    off_tokens = off_mask.sum()
    z = on_tokens + off_tokens if total_tokens is None else torch.as_tensor(total_tokens, dtype=on_mask.dtype)
    if float(z) <= 0:
        raise ValueError("hybrid_loss: no on-policy or gated expert tokens to normalise over")
    loss = ((on_policy_token_loss * on_mask).sum() + (-expert_log_probs * off_mask).sum()) / z
    metrics = {
        "ahpo/off_policy_token_share": float(off_tokens / (on_tokens + off_tokens).clamp(min=1.0)),
        "ahpo/expert_nll": float((-expert_log_probs.detach() * off_mask).sum() / off_tokens.clamp(min=1.0)),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# The Lightning module
# --------------------------------------------------------------------------------------------

GATE = "ahpo_gate"
TRACE_SHARE = "ahpo_trace_share"


class AHPOModule(GRPOModule):
    """AHPO (arXiv 2510.08540) on top of :class:`~mmpo.algos.grpo.GRPOModule`.

    Each gated prompt's expert trace is scored once per optimizer step: its NLL is split evenly
    over the prompt's G rollouts (weight 1/G per rollout), so micro-batching does not change
    the loss. The union normaliser Z needs the whole rollout in one optimizer step
    (``minibatch_size`` None or prompts x G; ``mu`` epochs are fine) and ``agg: token-mean``.

    Args:
        model_path: saved HF model directory.
        min_successes: R_hat: the gate opens when fewer rollouts than this have reward == success_value (2).
        success_value: reward of a fully correct rollout (1.0 = 0.9 accuracy + 0.1 format).
        static: Static-AHPO: the expert term is always on for prompts with a trace.
        expert_max_length: truncate expert traces to this many tokens (None = full trace).
        sampling: G 5 by default (paper).
        loss: reference KL coefficient ``beta`` 0 by default (paper: none); ``agg`` must be token-mean.
        **kwargs: every other :class:`GRPOModule` setting.
    """

    def __init__(
        self,
        model_path: str,
        *,
        min_successes: int = 2,
        success_value: float = 1.0,
        static: bool = False,
        expert_max_length: int | None = None,
        sampling: SamplingConfig = SamplingConfig(num_generations=5),
        loss: LossConfig = LossConfig(beta=0.0),
        **kwargs: Any,
    ) -> None:
        require(min_successes >= 1, f"min_successes must be >= 1, got {min_successes}")
        loss = as_config(loss, LossConfig(beta=0.0))
        agg = loss.agg
        require(agg == "token-mean",
                f"AHPO normalises over the union of on- and off-policy tokens: agg must be token-mean, got {agg!r}")
        super().__init__(model_path, sampling=as_config(sampling, SamplingConfig(num_generations=5)), loss=loss,
                         **kwargs)
        self._off_policy_tokens = torch.zeros(())

    def _trace_token_counts(self, traces: list[str]) -> Tensor:
        ids, mask = encode_completions(self.processor, traces, max_length=self.hparams.expert_max_length)
        return mask.sum(-1).to(torch.float32)

    # -- step 2: the gate, decided from the rollout rewards -------------------------------------

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        require(self.optim.minibatch_size in (None, len(rollout)),
                f"AHPO needs the whole rollout in one optimizer step (minibatch_size None or {len(rollout)}), "
                f"got minibatch_size {self.optim.minibatch_size}")
        advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
        has_trace = torch.tensor([bool(row.get("expert_trace")) for row in rollout.rows])
        prompt_ids, gate = expert_gate(rewards, group_ids, has_trace, min_successes=h.min_successes,
                                       success_value=h.success_value, static=h.static)
        index = build_group_index(group_ids, num_samples=len(rollout))
        gate_per_rollout = gate[index.inverse]
        rollout.extras[GATE] = gate_per_rollout
        # each gated trace counts once per step: 1/G of it rides on each of its G rollouts
        rollout.extras[TRACE_SHARE] = gate_per_rollout.float() / index.counts[index.inverse].float()
        off_tokens = torch.zeros(())
        if bool(gate_per_rollout.any()):
            first = {int(g): i for i, g in reversed(list(enumerate(group_ids.tolist())))}
            gated = [first[int(p)] for p, on in zip(prompt_ids.tolist(), gate.tolist()) if on]
            off_tokens = self._trace_token_counts([rollout.rows[i]["expert_trace"] for i in gated]).sum()
        # summed over ranks: Z counts every rank's tokens, like the trainer's normaliser
        self._off_policy_tokens = self._sum_over_ranks(off_tokens.to(self.device))
        on_tokens = float(rollout.completion_mask.sum())
        metrics["ahpo/gate_on_frac"] = float(gate.float().mean())
        metrics["ahpo/prompts_with_trace_frac"] = float(index.amax(has_trace.float()).mean())
        metrics["ahpo/off_policy_token_share"] = float(off_tokens) / max(on_tokens + float(off_tokens), 1.0)
        return advantages, metrics

    # -- step 3: expert NLL in the loss, one token-mean over on- and off-policy tokens ----------

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        parts = LossParts()
        off_total = self._off_policy_tokens.to(self.device)
        if float(off_total) == 0:
            return parts, {}  # no gate open anywhere: Z = on-policy tokens, plain GRPO
        h = self.hparams
        on_total = outputs["aggregation"].global_tokens  # token-mean (checked): the policy loss is sum_on / N_on
        z = on_total + off_total
        # rescale the trainer's policy part from sum_on / N_on to sum_on / Z (same graph, no second loss)
        parts.add("ahpo/policy_rescale", outputs["losses"]["policy"] * (on_total / z - 1.0))
        shares = minibatch.extras[TRACE_SHARE].to(self.device)
        metrics: dict[str, Any] = {}
        if bool((shares > 0).any()):
            # one forward per distinct gated prompt in this micro-batch, weighted by its share
            weight_by_row: dict[str, float] = {}
            row_by_id: dict[str, Mapping[str, Any]] = {}
            for row, share in zip(minibatch.rows, shares.tolist()):
                if share > 0:
                    key = str(row["id"])
                    weight_by_row[key] = weight_by_row.get(key, 0.0) + share
                    row_by_id[key] = row
            rows = [row_by_id[k] for k in weight_by_row]
            prompts = encode_prompts(self.processor, rows, system_prompt=self.engine.system_prompt,
                                     max_prompt_length=h.max_prompt_length)
            ids, mask = encode_completions(self.processor, [row["expert_trace"] for row in rows],
                                           max_length=h.expert_max_length)
            prompts = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in prompts.items()}
            expert_lp, _ = completion_log_probs(self.model, prompts, ids.to(self.device), mask.to(self.device),
                                                chunk_size=h.logprob_chunk_size)
            weights = torch.tensor(list(weight_by_row.values()), device=self.device)
            mask_f = mask.to(self.device, expert_lp.dtype)
            nll_sum = (-(expert_lp * mask_f).sum(-1) * weights).sum()
            parts.add("ahpo/expert_nll", nll_sum / z)
            metrics["ahpo/expert_nll"] = float(nll_sum.detach() / (mask_f.sum(-1) * weights).sum().clamp(min=1e-9))
        return parts, metrics
