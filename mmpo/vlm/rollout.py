"""Rollouts: G sampled completions per prompt with HF ``generate``.

The engine interface is one method, ``generate(rows, ...) -> Rollout``; the default
engine batches every prompt of a step into one ``model.generate`` call with
``num_return_sequences=G`` (Qwen-VL's generate expands pixel values per sample).
The vLLM engine (``rollout_engine: vllm``, :mod:`mmpo.vlm.vllm_engine`) has the same method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from transformers import BatchFeature, DynamicCache, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from mmpo.vlm.fsdp import full_weights
from mmpo.vlm.processing import encode_prompts, model_inputs, repeat_rows, select_rows, vision_token_ids


@dataclass
class Rollout:
    """Sampled completions, grouped contiguously by prompt.

    Shapes (N = number of prompts x samples per prompt, T = completion width):
        group_ids (N,) long: index of the prompt each completion answers.
        prompt_inputs: processor outputs repeated per sample (input_ids (N, P), ...).
        completion_ids (N, T) long: sampled tokens, pad after EOS.
        completion_mask (N, T) long: 1 on real completion tokens (EOS included), 0 after
            EOS and from the first vision token the policy emitted.

    ``extras`` holds per-completion tensors (first dim N) or values shared by the whole rollout;
    the HF engine always sets ``vision_cut`` (N,) bool: the completions the vision-token guard cut.
    """

    rows: list[Mapping[str, Any]]
    group_ids: torch.Tensor
    prompt_inputs: BatchFeature
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index: torch.Tensor | Sequence[int]) -> "Rollout":
        """Sub-rollout with completions ``index`` (for minibatches and group filters)."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = index.tolist()
        extras = {
            key: value[index] if isinstance(value, torch.Tensor) and value.shape[:1] == (len(self),) else value
            for key, value in self.extras.items()
        }
        return Rollout(
            rows=[self.rows[i] for i in picked],
            group_ids=self.group_ids[index],
            prompt_inputs=select_rows(self.prompt_inputs, index),
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            texts=[self.texts[i] for i in picked],
            extras=extras,
        )

    def to(self, device: torch.device | str) -> "Rollout":
        """Tensors moved to ``device`` (rows and texts unchanged)."""
        return Rollout(
            rows=self.rows,
            group_ids=self.group_ids.to(device),
            prompt_inputs=BatchFeature({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                        for k, v in self.prompt_inputs.items()}),
            completion_ids=self.completion_ids.to(device),
            completion_mask=self.completion_mask.to(device),
            texts=self.texts,
            extras={k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()},
        )


def completion_mask_from_ids(
    completion_ids: torch.Tensor, *, eos_token_id: int | Sequence[int], forbidden_ids: Sequence[int] = ()
) -> torch.Tensor:
    """(N, T) mask: 1 up to and including the first EOS; 0 after it and from the first forbidden token on.

    A forbidden (vision) token ends the completion like a broken EOS: it and everything after
    it are masked, so every scored token keeps exactly the context it was sampled in.
    Example: ids [a, b, EOS, pad] -> [1, 1, 1, 0]; [a, IMG, b] -> [1, 0, 0]; no EOS keeps all.
    """
    eos_ids = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    is_eos = torch.isin(completion_ids, eos_ids.to(completion_ids.device)).long()
    # tokens strictly after the first EOS: the running count of EOS before this position is > 0
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    mask = eos_before == 0
    if forbidden_ids:
        forbidden = torch.isin(completion_ids, torch.as_tensor(list(forbidden_ids), device=completion_ids.device))
        mask &= torch.cumsum(forbidden.long(), dim=1) == 0
    return mask.long()


class HFGenerateEngine:
    """Batched sampling with ``model.generate`` (the default rollout engine).

    Args:
        model: a Qwen-VL ``...ForConditionalGeneration`` (or any HF VLM with generate).
        processor: its processor.
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT``.
        max_prompt_length: refuse longer prompts (never truncated).
        prefill_once: with G > 1 sampled completions per prompt, encode each image and prefill each
            prompt once, then copy its KV cache to G rows and decode them (:meth:`_prefill`); False
            gives HF's own ``num_return_sequences`` path, which runs the vision tower and the prompt
            G times. Both sample the same tokens from the same log-probs (tests/vlm/test_rollout.py).
    """

    def __init__(self, model: Any, processor: Any, *, system_prompt: str | None = "default",
                 max_prompt_length: int | None = None, prefill_once: bool = True) -> None:
        self.model = model
        self.prefill_once = prefill_once
        self.processor = processor
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        tokenizer = processor.tokenizer
        self.eos_token_id = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.forbidden_ids = vision_token_ids(processor)

    @torch.no_grad()
    def suppressed_token_ids(self) -> list[int] | None:
        """The vision special tokens plus any the model's generation config already suppresses (a passed
        ``suppress_tokens`` replaces the config's list, so both are merged); None when there are none."""
        configured = getattr(self.model.generation_config, "suppress_tokens", None) or []
        merged = sorted(set(configured) | set(self.forbidden_ids))
        return merged or None

    def generate(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        do_sample: bool = True,
        return_log_probs: bool = False,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> Rollout:
        """Sample ``num_samples`` completions for every row; groups are contiguous.

        Vision special tokens (``<|image_pad|>``, ``<|vision_start|>``, ...: :func:`vision_token_ids`) are
        suppressed while decoding (HF's ``suppress_tokens``: their logits are -inf before temperature and
        top-p, as TRL suppresses ``<|image_pad|>``), so they are never sampled. A guard stays: should one
        appear anyway, it ends its completion: it and the rest are replaced by pad and masked out (fed back
        in a forward pass it would break the image-token/feature count, R1-V#91), and
        ``extras["vision_cut"]`` marks that completion. Sampling uses torch's global RNG (seed it, or wrap
        in ``fork_rng``).

        ``return_log_probs=True`` also stores the sampled tokens' log-probs as the sampler saw them
        (after its temperature / top-p processing) in ``rollout.extras["engine_log_probs"]`` (N, T)
        float32, 0 off ``completion_mask``: the rollout policy of the IS correction
        (:func:`mmpo.core.rollout_is_weights`). Off by default (one extra log-softmax per step).

        ``logits_processors`` run on each step's raw logits before the temperature / top-p warpers
        (e.g. HAPO's per-token temperature, ``mmpo.algos.hapo``).
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        rows = list(rows)
        device = next(self.model.parameters()).device
        prompts = encode_prompts(
            self.processor, rows, system_prompt=self.system_prompt, max_prompt_length=self.max_prompt_length
        )
        inputs = {k: v.to(device) for k, v in model_inputs(prompts).items()}
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None)
        # HF's SuppressTokensLogitsProcessor runs before user processors and warpers: the recorder below
        # sees the distribution the sampler really draws from (vision tokens at probability 0)
        sampling["suppress_tokens"] = self.suppressed_token_ids()
        recorder = _SampledLogProbRecorder() if return_log_probs else None
        if recorder is not None:
            # HF runs user processors before its own temperature / top-p warpers; to see the scores the
            # sampler draws from, the same HF warpers run here, in HF's order, with the recorder last
            warpers = [TemperatureLogitsWarper(temperature)] if do_sample and temperature != 1.0 else []
            warpers += [TopPLogitsWarper(top_p)] if do_sample and top_p < 1.0 else []
            sampling = {**sampling, "temperature": 1.0, "top_p": 1.0} if do_sample else sampling
            sampling["logits_processor"] = LogitsProcessorList([*logits_processors, *warpers, recorder])
        elif logits_processors:  # HF runs these before its own temperature / top-p warpers
            sampling["logits_processor"] = LogitsProcessorList(list(logits_processors))
        was_training = self.model.training
        self.model.eval()
        special = dict(eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, use_cache=True)
        try:
            # greedy samples are identical: decode once, repeat below
            copies = num_samples if do_sample else 1
            with full_weights(self.model):  # FSDP2: gathered once for the prefill and the decode (mmpo.vlm.fsdp)
                if copies > 1 and self.prefill_once and inputs["input_ids"].shape[1] >= 2:
                    inputs, copies = self._prefill(inputs, copies, special), 1
                output = self.model.generate(
                    **inputs, max_new_tokens=max_new_tokens, num_return_sequences=copies, **special, **sampling
                )
        finally:
            self.model.train(was_training)
        prompt_width = inputs["input_ids"].shape[1]
        engine_log_probs = None if recorder is None else recorder.finish(output)
        if not do_sample:
            output = output.repeat_interleave(num_samples, dim=0)
            if engine_log_probs is not None:
                engine_log_probs = engine_log_probs.repeat_interleave(num_samples, dim=0)
        completion_ids = output[:, prompt_width:].cpu()
        if completion_ids.shape[1] == 0:
            completion_ids = torch.full((completion_ids.shape[0], 1), self.pad_token_id, dtype=torch.long)
        completion_mask = completion_mask_from_ids(
            completion_ids, eos_token_id=self.eos_token_id, forbidden_ids=self.forbidden_ids
        )
        # the guard's count: completions a vision token cut (0 while suppression works)
        extras: dict[str, Any] = {
            "vision_cut": _cut_by(completion_ids, eos_token_id=self.eos_token_id, forbidden_ids=self.forbidden_ids)}
        # vision tokens and post-EOS tokens become pad, so the ids are safe to feed back.
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.pad_token_id)
        texts = self.processor.batch_decode(completion_ids, skip_special_tokens=True)
        group_ids = torch.arange(len(rows)).repeat_interleave(num_samples)
        if engine_log_probs is not None:
            if engine_log_probs.shape != completion_mask.shape:  # empty completion: one pad column
                engine_log_probs = torch.zeros(completion_mask.shape)
            extras["engine_log_probs"] = engine_log_probs.masked_fill(completion_mask == 0, 0.0)
        return Rollout(
            rows=[rows[i] for i in group_ids.tolist()],
            group_ids=group_ids,
            prompt_inputs=repeat_rows(prompts, num_samples),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            texts=texts,
            extras=extras,
        )

    def _prefill(self, inputs: dict[str, Any], copies: int, special: Mapping[str, Any]) -> dict[str, Any]:
        """Generate inputs for ``copies`` rows per prompt whose prompts are already in a KV cache.

        Each prompt but its last token runs once through the model (vision tower included); the cache
        is copied to ``copies`` rows (``Cache.batch_repeat_interleave``), and the decoding ``generate``
        then only feeds the last prompt token per row. Qwen-VL keeps the prompt's RoPE offsets in
        ``model.rope_deltas`` (one row per prompt); they are copied likewise, as HF's own
        ``num_return_sequences`` expansion would have computed them per row.
        """
        head = {key: value[:, :-1] for key, value in inputs.items()
                if key in ("input_ids", "attention_mask", "mm_token_type_ids")}
        head.update({key: value for key, value in inputs.items() if key in ("pixel_values", "image_grid_thw")})
        backbone = getattr(self.model, "model", None)
        if "image_grid_thw" in head and hasattr(backbone, "get_rope_index"):
            # one forward with Qwen-VL's own 3-D RoPE positions (what generate's first step computes),
            # without generate's per-call set-up
            positions, deltas = backbone.get_rope_index(
                head["input_ids"], mm_token_type_ids=head["mm_token_type_ids"],
                image_grid_thw=head["image_grid_thw"], attention_mask=head["attention_mask"])
            cache = DynamicCache(config=self.model.config)
            self.model(**head, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
            backbone.rope_deltas = deltas
        else:  # any other model or a text-only batch: HF's generate prefills (one greedy token, no RNG)
            # min length off: a generation_config that forces long completions must not apply to this one token
            cache = self.model.generate(**head, max_new_tokens=1, min_new_tokens=0, do_sample=False,
                                        temperature=None, top_p=None, top_k=None, return_dict_in_generate=True,
                                        **special).cache
        cache.batch_repeat_interleave(copies)
        if getattr(backbone, "rope_deltas", None) is not None:
            backbone.rope_deltas = backbone.rope_deltas.repeat_interleave(copies, dim=0)
        # the image features live in the cache now: no pixel values (the vision tower does not run again)
        expanded = {key: value.repeat_interleave(copies, dim=0) for key, value in inputs.items()
                    if key in ("input_ids", "attention_mask", "mm_token_type_ids")}
        return {**expanded, "cache": cache}


def _cut_by(completion_ids: torch.Tensor, *, eos_token_id: int | Sequence[int],
            forbidden_ids: Sequence[int]) -> torch.Tensor:
    """(N,) bool: the completions the vision-token guard of :func:`completion_mask_from_ids` cut, i.e.
    whose mask with the guard is shorter than without it. Example (EOS e, vision token I):
    [a, I, b] -> True; [a, e, I] -> False (the EOS ended it first); [a, b, c] -> False."""
    if not forbidden_ids:
        return torch.zeros(completion_ids.shape[0], dtype=torch.bool)
    guarded = completion_mask_from_ids(completion_ids, eos_token_id=eos_token_id, forbidden_ids=forbidden_ids)
    return (completion_mask_from_ids(completion_ids, eos_token_id=eos_token_id) != guarded).any(-1)


class _SampledLogProbRecorder(LogitsProcessor):
    """The last logits processor of a sampling ``generate``: records log pi of each sampled token
    under the distribution it was drawn from, holding one step's (N, V) log-softmax at a time
    (``output_scores`` would keep every step's). A step's token is only known at the next call
    (the last input id), or, for the final step, from the returned sequences (:meth:`finish`)."""

    def __init__(self) -> None:
        self._columns: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids[:, -1:])
        self._previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._previous is not None:
            self._columns.append(self._previous.gather(-1, tokens).squeeze(-1))
            self._previous = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(N, T) float32 on CPU; a token the sampler could not draw (after EOS: pad) may be -inf."""
        self._take(sequences[:, -1:])
        if not self._columns:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self._columns, dim=1).cpu()


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Concatenate rollouts (group ids are renumbered so groups stay distinct; prompts are
    re-left-padded and completions right-padded to the widest)."""
    from torch.nn.functional import pad

    if not rollouts:
        raise ValueError("concat_rollouts: nothing to concatenate")
    width = max(r.completion_ids.shape[1] for r in rollouts)
    pad_id = int(rollouts[0].completion_ids.new_tensor(0))  # ids are masked beyond the mask anyway
    prompt_width = max(r.prompt_inputs["input_ids"].shape[1] for r in rollouts)
    rows, texts, groups, ids, masks, prompt_parts = [], [], [], [], [], []
    offset = 0
    for r in rollouts:
        rows += r.rows
        texts += r.texts
        groups.append(r.group_ids + offset)
        offset += int(r.group_ids.max()) + 1
        extra = width - r.completion_ids.shape[1]
        ids.append(pad(r.completion_ids, (0, extra), value=pad_id))
        masks.append(pad(r.completion_mask, (0, extra), value=0))
        prompt_parts.append(_left_pad_prompts(r.prompt_inputs, prompt_width))
    prompt_inputs: dict[str, Any] = {}
    for key in prompt_parts[0]:
        values = [p[key] for p in prompt_parts if key in p]
        prompt_inputs[key] = torch.cat(values, 0)
    return Rollout(rows, torch.cat(groups), BatchFeature(prompt_inputs), torch.cat(ids), torch.cat(masks), texts,
                   extras=_concat_extras(rollouts, width))


def _concat_extras(rollouts: Sequence[Rollout], width: int) -> dict[str, Any]:
    """Per-completion tensors (first dim N) are concatenated, (N, T) ones right-padded to ``width``;
    other values must agree across rollouts (e.g. a step number)."""
    from torch.nn.functional import pad

    out: dict[str, Any] = {}
    for key in rollouts[0].extras:
        values = [r.extras.get(key) for r in rollouts]
        if all(isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == len(r) for v, r in zip(values, rollouts)):
            if values[0].ndim == 2:
                values = [pad(v, (0, width - v.shape[1])) for v in values]
            out[key] = torch.cat(values, 0)
        elif all(not isinstance(v, torch.Tensor) and v == values[0] for v in values):
            out[key] = values[0]
        else:
            raise ValueError(f"concat_rollouts: extras[{key!r}] is neither per-completion nor shared by all rollouts")
    return out


def _left_pad_prompts(inputs: Mapping[str, Any], width: int) -> dict[str, Any]:
    from torch.nn.functional import pad

    out = dict(inputs)
    extra = width - inputs["input_ids"].shape[1]
    if extra:
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if key in out:
                out[key] = pad(out[key], (extra, 0), value=0)
    return out
