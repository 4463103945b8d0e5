"""DR-PO (Dataset Reset Policy Optimization, arXiv 2404.08495) on the GRPO trainer.

DR-PO is online RL whose episodes may start not from the prompt but from a state of the offline
preference data: a prefix of a preferred response ("dataset reset"). The policy then writes the
rest, the reward scores the whole response, and only the generated tokens are trained. The KL
regulariser is the RLHF one of the paper's PPO: a per-token -kl_coef (log pi - log pi_ref) in the
reward (official code ``Cornell-RL/drpo`` ``src/tldr/drpo.py``: ``non_score_reward = -kl_ctl.value * kl``,
``kl_coef`` 0.05), which with gamma 1 and an outcome reward sums to a sequence penalty on the return.

What this module implements, on top of :class:`~mmpo.algos.grpo.GRPOModule` (its ``build_rollout`` and
``compute_rewards`` hooks, as the other GRPO variants):

1. reset        with probability ``reset_prob`` a prompt's group of G samples starts from a prefix of
                its preferred response (the row's ``chosen``, or its rendered reference solution):
                h tokens with h ~ Uniform{1, ..., L - 1}; the prefix joins the prompt (attended, never
                trained: the official code masks the roll-in tokens out of the policy loss)
2. rewards      computed on prefix + continuation (the whole response), minus
                ``kl_reward_coef * sum_t (log pi_old - log pi_ref)`` over the generated tokens
3. the rest     GRPO's group-relative advantages, clipped loss, optimizer step.

Differences from the paper, by design: the advantage is GRPO's group-relative one, not PPO's learned
critic with GAE, so the G samples of a group share one reset state (the paper draws a reset per
episode); the KL penalty covers the generated tokens only (the official code also charges the forced
roll-in tokens, where the policy is not trained). The paper's theory (the NPG-style update with
optimistic exploration) is not implemented.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from transformers import BatchFeature

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import LossConfig, as_config
from mmpo.vlm.factory import make_reference_model
from mmpo.vlm.processing import encode_prompts, model_inputs, repeat_rows
from mmpo.vlm.rollout import HFGenerateEngine, Rollout, _cut_by, completion_mask_from_ids, concat_rollouts


def preferred_response(row: Mapping[str, Any]) -> str:
    """The row's offline preferred response: ``chosen`` (preference data) or its reference solution."""
    if isinstance(row.get("chosen"), str):
        return row["chosen"]
    from mmpo.data import render_solution

    if not row.get("answer"):
        raise ValueError(f"row {row.get('id')!r} has neither 'chosen' nor an answer to render: a dataset reset needs "
                         "a preferred response")
    return render_solution(dict(row))


def reset_prefix_lengths(response_lengths: Sequence[int], generator: torch.Generator | None = None) -> list[int]:
    """h ~ Uniform{1, ..., L - 1} tokens per response (0 when L < 2: nothing to reset into)."""
    return [int(torch.randint(1, n, (1,), generator=generator)) if n >= 2 else 0 for n in response_lengths]


def append_prefixes(prompts: Mapping[str, Any], prefixes: Sequence[Sequence[int]], pad_token_id: int) -> BatchFeature:
    """Left-padded prompts with ``prefixes[i]`` (token ids) appended to row i, re-left-padded to one width.

    The prefix tokens are text (``mm_token_type_ids`` 0) and attended; images are untouched.
    """
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    types = prompts.get("mm_token_type_ids")
    rows_ids, rows_types = [], []
    for i, prefix in enumerate(prefixes):
        keep = mask[i].bool()
        extra = torch.as_tensor(list(prefix), dtype=ids.dtype)
        rows_ids.append(torch.cat([ids[i][keep], extra]))
        if types is not None:
            rows_types.append(torch.cat([types[i][keep], torch.zeros_like(extra, dtype=types.dtype)]))
    width = max(len(r) for r in rows_ids)
    out = dict(prompts)
    out["input_ids"] = torch.stack([torch.cat([r.new_full((width - len(r),), pad_token_id), r]) for r in rows_ids])
    out["attention_mask"] = torch.stack([torch.cat([mask.new_zeros(width - len(r)), mask.new_ones(len(r))])
                                         for r in rows_ids])
    if types is not None:
        out["mm_token_type_ids"] = torch.stack([torch.cat([t.new_zeros(width - len(t)), t]) for t in rows_types])
    return BatchFeature(out)


@torch.no_grad()
def prefix_rollout(engine: HFGenerateEngine, rows: Sequence[Mapping[str, Any]], prefixes: Sequence[Sequence[int]], *,
                   num_samples: int, max_new_tokens: int, temperature: float, top_p: float) -> Rollout:
    """G sampled continuations of prompt + prefix per row (the engine's sampling settings and masks).

    ``texts`` are prefix + continuation (what the rewards score); ``prompt_inputs`` include the prefix,
    so the trainer's log-probs are those of the continuation given the reset state. As the engine's own
    rollouts, vision special tokens are suppressed while decoding and ``extras["vision_cut"]`` (N,) marks
    the completions the guard cut, so a batch of reset and fresh groups concatenates.
    """
    tokenizer = engine.processor.tokenizer
    prompts = encode_prompts(engine.processor, list(rows), system_prompt=engine.system_prompt,
                             max_prompt_length=engine.max_prompt_length)
    prompts = append_prefixes(prompts, prefixes, engine.pad_token_id)
    device = next(engine.model.parameters()).device
    inputs = {k: v.to(device) for k, v in model_inputs(prompts).items()}
    was_training = engine.model.training
    engine.model.eval()
    try:
        output = engine.model.generate(**inputs, max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                                       eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id,
                                       use_cache=True, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                       suppress_tokens=engine.suppressed_token_ids())
    finally:
        engine.model.train(was_training)
    completion_ids = output[:, inputs["input_ids"].shape[1]:].cpu()
    mask = completion_mask_from_ids(completion_ids, eos_token_id=engine.eos_token_id, forbidden_ids=engine.forbidden_ids)
    vision_cut = _cut_by(completion_ids, eos_token_id=engine.eos_token_id, forbidden_ids=engine.forbidden_ids)
    completion_ids = completion_ids.masked_fill(mask == 0, engine.pad_token_id)
    group_ids = torch.arange(len(rows)).repeat_interleave(num_samples)
    prefix_texts = [tokenizer.decode(list(p), skip_special_tokens=True) for p in prefixes]
    continuations = engine.processor.batch_decode(completion_ids, skip_special_tokens=True)
    texts = [prefix_texts[g] + text for g, text in zip(group_ids.tolist(), continuations)]
    return Rollout(rows=[rows[g] for g in group_ids.tolist()], group_ids=group_ids,
                   prompt_inputs=repeat_rows(prompts, num_samples), completion_ids=completion_ids,
                   completion_mask=mask, texts=texts, extras={"vision_cut": vision_cut})


class DRPOModule(GRPOModule):
    """GRPO with DR-PO's dataset resets and KL-in-reward regulariser (see the module docstring).

    Args:
        reset_prob: probability that a prompt's group starts from a prefix of its preferred response.
        kl_reward_coef: the paper's kl_coef: the reward loses kl_reward_coef * sum_t (log pi_old - log pi_ref)
            over the generated tokens (0.05 in the official code); 0 = no KL in the reward (GRPO's ``beta``
            still adds its KL to the loss when set).
        loss: GRPO's loss; its in-loss KL coefficient ``beta`` is 0 by default (the paper's KL is the one in the
            reward).
        **kwargs: every :class:`~mmpo.algos.grpo.GRPOModule` setting (num_generations, loss, advantage, ...).
    """

    def __init__(self, model_path: str, reset_prob: float = 0.5, kl_reward_coef: float = 0.05,
                 loss: LossConfig = LossConfig(beta=0.0), **kwargs: Any) -> None:
        super().__init__(model_path, loss=as_config(loss, LossConfig(beta=0.0)), **kwargs)
        if kl_reward_coef > 0 and self._reference[0] is None:  # GRPO builds pi_ref only for an in-loss KL
            self._reference = [make_reference_model(self.model, 1.0)]
        self.reset_fraction = 0.0

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(0.0 <= h.reset_prob <= 1.0, f"reset_prob must be in [0, 1], got {h.reset_prob}")
        require(h.kl_reward_coef >= 0, f"kl_reward_coef must be >= 0, got {h.kl_reward_coef}")
        require(h.reset_prob == 0 or (self.rollout_correction.mode is None and not self.rollout_correction.bypass),
                "dataset resets sample with their own generate call, which records no engine log-probs: "
                "set rollout_is null and rollout_bypass false, or reset_prob 0")

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """Groups of rows drawn for a reset continue a prefix of their preferred response; the others start
        at the prompt. Called under GRPO's per-step sampling seed, so the draws are reproducible."""
        h = self.hparams
        rows = list(rows)
        tokenizer = self.processor.tokenizer
        draws = torch.rand(len(rows)) < h.reset_prob
        responses = {i: tokenizer(preferred_response(rows[i]), add_special_tokens=False)["input_ids"]
                     for i in range(len(rows)) if draws[i]}
        lengths = dict(zip(responses, reset_prefix_lengths([len(r) for r in responses.values()])))
        reset = [i for i in responses if lengths[i] > 0]
        fresh = [i for i in range(len(rows)) if i not in reset]
        self.reset_fraction = len(reset) / len(rows)
        parts = []
        if fresh:
            parts.append(super().build_rollout([rows[i] for i in fresh]))
        if reset:
            parts.append(prefix_rollout(self.engine, [rows[i] for i in reset],
                                        [responses[i][: lengths[i]] for i in reset],
                                        num_samples=self.sampling.num_generations,
                                        max_new_tokens=self.sampling.max_new_tokens,
                                        temperature=self.sampling.temperature, top_p=self.sampling.top_p))
        return parts[0] if len(parts) == 1 else concat_rollouts(parts)

    def compute_rewards(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """Task rewards on the whole response, minus the paper's KL penalty (summed over generated tokens)."""
        total, metrics = super().compute_rewards(rollout)
        metrics["reset/fraction"] = self.reset_fraction
        h = self.hparams
        if h.kl_reward_coef == 0:
            return total, metrics
        on_device = rollout.to(self.device)
        micro = self.optim.micro_batch_size or len(rollout)
        policy = self._log_probs_no_grad(self.model, on_device, micro)
        reference = self._log_probs_no_grad(self.reference_model, on_device, micro)
        kl = ((policy - reference) * on_device.completion_mask.to(policy)).sum(-1).cpu()
        metrics["rewards/kl_penalty/mean"] = float(-h.kl_reward_coef * kl.mean())
        return total - h.kl_reward_coef * kl.to(total), metrics
