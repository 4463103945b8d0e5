"""Rollouts: G sampled completions per prompt with HF ``generate`` or a lean decoding loop.

The engine interface is one method, ``generate(rows, ...) -> Rollout``; the default engine
prefills every prompt of a step once, copies its KV cache to G rows and decodes them all in one
batch: on a Qwen2.5-VL with a sampling configuration it covers, by its own loop
(:meth:`HFGenerateEngine._lean_decode`, the same tokens as HF ``generate`` from the same RNG
state), otherwise by ``model.generate`` (:func:`lean_decode_blocker` names why).
The vLLM engine (``rollout_engine: vllm``, :mod:`mmpo.vlm.vllm_engine`) has the same method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from transformers import (
    BatchFeature,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from mmpo.vlm.factory import turn_end_token_id
from mmpo.vlm.fsdp import full_weights
from mmpo.vlm.processing import (encode_prompts, model_inputs, padded_positions, repeat_rows, select_rows,
                                 vision_token_ids)


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


def completion_attention_mask(rollout: Rollout) -> torch.Tensor:
    """(N, T) the completion's attention mask in a training forward: ``extras["completion_attention_mask"]`` of a
    multi-turn rollout (:mod:`mmpo.vlm.multiturn`: environment tokens attended but out of the loss, i.e. holes
    in ``completion_mask``), else the completion mask itself (single-turn: the same thing)."""
    return rollout.extras.get("completion_attention_mask", rollout.completion_mask)


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
    """Batched sampling with transformers models (the default rollout engine).

    Args:
        model: a Qwen-VL ``...ForConditionalGeneration`` (or any HF VLM with generate).
        processor: its processor.
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT``.
        max_prompt_length: refuse longer prompts (never truncated).
        prefill_once: with G > 1 sampled completions per prompt, encode each image and prefill each
            prompt once, then copy its KV cache to G rows and decode them (:meth:`_prefill`); False
            gives HF's own ``num_return_sequences`` path, which runs the vision tower and the prompt
            G times. Both sample the same tokens from the same log-probs (tests/vlm/test_rollout.py).
        lean_decode: after that prefill, decode by :meth:`_lean_decode` (the same tokens as HF ``generate``
            from the same RNG state, with less overhead per token) wherever :func:`lean_decode_blocker` finds
            nothing it does not cover; False always decodes with ``model.generate``.

    ``last_decode`` says how the last :meth:`generate` call decoded: ``"lean"``, or why ``model.generate`` did.
    """

    def __init__(self, model: Any, processor: Any, *, system_prompt: str | None = "default",
                 max_prompt_length: int | None = None, prefill_once: bool = True, lean_decode: bool = True) -> None:
        self.model = model
        self.prefill_once = prefill_once
        self.lean_decode = lean_decode
        self.last_decode = ""
        self.processor = processor
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        tokenizer = processor.tokenizer
        self.eos_token_id = turn_end_token_id(tokenizer)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.forbidden_ids = vision_token_ids(processor)
        self.kept_cache: _GrowingKVCache | None = None
        self._last_lean_cache: _GrowingKVCache | None = None

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
        keep_cache: bool = False,
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

        ``keep_cache=True`` (multi-turn rollouts, :mod:`mmpo.vlm.multiturn`): when the lean loop decoded, its KV cache
        (a :class:`_GrowingKVCache` of the N rows, holding each prompt and all but the last decoded step) is left in
        ``self.kept_cache`` for the next turn to continue; otherwise ``self.kept_cache`` is None.
        """
        self.kept_cache = None
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
        lean = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    logits_processors=list(logits_processors), return_log_probs=return_log_probs)
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
            cache_copies = 1  # rows each row of a prefilled cache becomes
            # FSDP2: gathered once for the prefill and the decode (mmpo.vlm.fsdp); no autograd graph for the prefill
            with full_weights(self.model), torch.no_grad():
                if copies > 1 and self.prefill_once and inputs["input_ids"].shape[1] >= 2:
                    inputs, cache_copies, copies = self._prefill(inputs, copies, special, expand_cache=False), copies, 1
                blocker = "lean_decode=False" if not self.lean_decode else lean_decode_blocker(
                    self.model, inputs, do_sample=do_sample, max_new_tokens=max_new_tokens)
                self.last_decode = blocker or "lean"
                if blocker is None:
                    output, engine_log_probs = self._lean_decode(inputs, cache_copies=cache_copies, **lean)
                    if keep_cache:
                        self.kept_cache = self._last_lean_cache
                    self._last_lean_cache = None
                else:
                    if cache_copies > 1:
                        inputs["cache"].batch_repeat_interleave(cache_copies)
                    output = self.model.generate(
                        **inputs, max_new_tokens=max_new_tokens, num_return_sequences=copies, **special, **sampling
                    )
                    engine_log_probs = None if recorder is None else recorder.finish(output)
        finally:
            self.model.train(was_training)
        prompt_width = inputs["input_ids"].shape[1]
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

    def _prefill(self, inputs: dict[str, Any], copies: int, special: Mapping[str, Any], *,
                 expand_cache: bool = True) -> dict[str, Any]:
        """Generate inputs for ``copies`` rows per prompt whose prompts are already in a KV cache.

        Each prompt but its last token runs once through the model (vision tower included); the cache
        is copied to ``copies`` rows (``Cache.batch_repeat_interleave``), and the decoding ``generate``
        then only feeds the last prompt token per row. Qwen-VL keeps the prompt's RoPE offsets in
        ``model.rope_deltas`` (one row per prompt); they are copied likewise, as HF's own
        ``num_return_sequences`` expansion would have computed them per row. ``expand_cache=False``
        leaves the cache at one row per prompt (the lean loop copies it into its own buffers of
        ``copies`` rows per prompt, :class:`_GrowingKVCache`, without an expanded copy in between).
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
        elif not hasattr(backbone, "language_model") and "pixel_values" not in head:
            # a text LM: one forward at HF generate's positions (each row's count of real tokens before it)
            cache = DynamicCache(config=self.model.config)
            self.model(**head, position_ids=padded_positions(head["attention_mask"]), cache=cache, use_cache=True,
                       logits_to_keep=1)
        else:  # any other model or a text-only batch: HF's generate prefills (one greedy token, no RNG)
            # min length off: a generation_config that forces long completions must not apply to this one token
            cache = self.model.generate(**head, max_new_tokens=1, min_new_tokens=0, do_sample=False,
                                        temperature=None, top_p=None, top_k=None, return_dict_in_generate=True,
                                        **special).cache
        if expand_cache:
            cache.batch_repeat_interleave(copies)
        if getattr(backbone, "rope_deltas", None) is not None:
            backbone.rope_deltas = backbone.rope_deltas.repeat_interleave(copies, dim=0)
        # the image features live in the cache now: no pixel values (the vision tower does not run again)
        expanded = {key: value.repeat_interleave(copies, dim=0) for key, value in inputs.items()
                    if key in ("input_ids", "attention_mask", "mm_token_type_ids")}
        return {**expanded, "cache": cache}

    # Why a hand-written loop: at the tiny widths mmpo trains on CPU, HF ``generate``'s per-token Python work (its
    # logits-processor and stopping-criteria objects, ``prepare_inputs_for_generation``, the per-step kwargs
    # updates, the Qwen-VL wrappers' position and mask set-up, DynamicCache's torch.cat) costs about as much as
    # the model's arithmetic; no maintained library offers a low-overhead CPU decode loop for these models
    # (vLLM's CPU build is a separate venv and install, docs/vllm.md), and a static cache with torch.compile does
    # not pay on CPU (bench/RESULTS.md). The loop below reproduces HF's ``_sample`` step for step (transformers
    # 5.24 ``GenerationMixin._sample``), so the same RNG state samples the same tokens (tests/vlm/test_lean_decode.py).
    def _lean_decode(self, inputs: Mapping[str, Any], *, cache_copies: int, max_new_tokens: int, temperature: float,
                     top_p: float, logits_processors: Sequence[LogitsProcessor], return_log_probs: bool,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_lean_steps` under ``torch.inference_mode`` (no autograd bookkeeping at all, not even version
        counters: ~5% of the loop's time, the same values) unless the user passed logits processors (those run
        as under HF generate: no_grad, so any tensor they keep stays an ordinary one). The results are returned
        as ordinary tensors: the training forward embeds these ids, and an inference tensor cannot be saved for
        backward."""
        with torch.no_grad(), torch.inference_mode(not logits_processors):
            sequences, log_probs = self._lean_steps(
                inputs, cache_copies=cache_copies, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, logits_processors=logits_processors, return_log_probs=return_log_probs)
        return sequences.clone(), None if log_probs is None else log_probs.clone()

    def _lean_steps(self, inputs: Mapping[str, Any], *, cache_copies: int, max_new_tokens: int, temperature: float,
                    top_p: float, logits_processors: Sequence[LogitsProcessor], return_log_probs: bool,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample up to ``max_new_tokens`` tokens per row after :meth:`_prefill`, as HF ``_sample`` would.

        ``inputs``: ``input_ids`` / ``attention_mask`` (N, P) the left-padded prompts, ``cache`` holding all
        but each prompt's last token (N / ``cache_copies`` rows: each is row-repeated ``cache_copies`` times),
        and the backbone's ``rope_deltas`` (N, 1) set. Per step, as HF: the
        last token through the text decoder at its position; the last logits in float32; vision tokens
        (and EOS while fewer than the generation config's ``min_new_tokens`` were drawn) to -inf; the user's
        ``logits_processors``; temperature and top-p (HF's warpers); ``torch.multinomial(softmax(scores), 1)``;
        pad after a row's EOS; stop when every row has ended or at ``max_new_tokens``.

        Returns the sequences (N, P + T) and, with ``return_log_probs``, the log-probs (N, T) float32 on CPU
        of the sampled tokens under the distribution they were drawn from (:class:`_SampledLogProbRecorder`'s).

        ``inputs["cache"]`` may also be a :class:`_GrowingKVCache` of the N rows holding all but the last column of
        ``input_ids`` (a multi-turn rollout's kept cache; ``attention_mask`` 0 marks its hidden positions): it is
        appended to in place. The cache used is left in ``self._last_lean_cache``.
        """
        model = self.model
        # the text decoder: a VLM's language model, or a text LM's own decoder (model.model)
        text = getattr(model.model, "language_model", model.model)
        multimodal_rope = text is not model.model  # Qwen-VL: 3-D RoPE positions, offsets in rope_deltas
        prompt_ids, attention = inputs["input_ids"], inputs["attention_mask"]
        rows, width = prompt_ids.shape
        device = prompt_ids.device
        cache = inputs["cache"]
        if isinstance(cache, _GrowingKVCache):
            cache.reserve(max_new_tokens)
        else:
            cache = _GrowingKVCache(cache, max_new_tokens, copies=cache_copies)
        self._last_lean_cache = cache
        # HF's positions (_prepare_position_ids_for_generation, then +1 a step) plus Qwen-VL's RoPE offsets: a new
        # token's position is the row's count of real tokens before it + the prompt's delta, equal on the 3 axes
        start = (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 0)[:, -1:]
        if multimodal_rope:
            start = start + model.model.rope_deltas
        sequences = prompt_ids.new_full((rows, width + max_new_tokens), self.pad_token_id)
        sequences[:, :width] = prompt_ids
        # HF's sdpa mask for one query: none without padding, else the 2-D mask as (N, 1, 1, kv) booleans
        visible = None
        if not bool(attention.all()):
            visible = torch.ones(rows, 1, 1, width + max_new_tokens, dtype=torch.bool, device=device)
            visible[:, 0, 0, :width] = attention.bool()
        # HF's SuppressTokens and MinNewTokensLength processors as one mask each (both set -inf; order is moot)
        banned = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool, device=device)
        banned[self.suppressed_token_ids() or []] = True
        banned_early = banned.clone()
        banned_early[self.eos_token_id] = True
        min_new_tokens = model.generation_config.min_new_tokens or 0
        # after the user's processors, HF's warpers in HF's order (top_k = 0: none)
        processors = [*logits_processors, *([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []),
                      *([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])]
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        columns: list[torch.Tensor] = []
        length = width
        # each layer's step: HF's own ops called directly where that is the same computation (decode_layer_step)
        steps = [decode_layer_step if direct_decode_layer(layer) else None for layer in text.layers]
        for step in range(max_new_tokens):
            hidden = text.embed_tokens(sequences[:, length - 1:length])
            positions = (start + step).view(1, rows, 1) if multimodal_rope else (start + step).view(rows, 1)
            rope = text.rotary_emb(hidden, positions)
            mask = None if visible is None else visible[..., :length]
            for layer, direct in zip(text.layers, steps):
                if direct is not None:
                    hidden = direct(layer, hidden, mask, rope, cache)
                else:
                    hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None,
                                   cache=cache, use_cache=True)
            scores = model.lm_head(text.norm(hidden)[:, -1]).float()  # a fresh tensor: filled in place
            scores.masked_fill_(banned_early if step < min_new_tokens else banned, -math.inf)
            for processor in processors:
                scores = processor(sequences[:, :length], scores)
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            tokens = torch.where(unfinished, tokens, self.pad_token_id)  # pad after a row's EOS
            if return_log_probs:
                columns.append(torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
            sequences[:, length] = tokens
            length += 1
            unfinished &= tokens != self.eos_token_id
            if not unfinished.any():
                break
        log_probs = torch.stack(columns, dim=1).cpu() if return_log_probs else None
        return sequences[:, :length], log_probs


# the text decoders whose layer step :func:`decode_layer_step` computes with the layer's own modules and HF's ops
_DIRECT_LAYER_PARTS = {
    "Qwen3DecoderLayer": ("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
    "Qwen2DecoderLayer": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "LlamaDecoderLayer": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
}


def direct_decode_layer(layer: torch.nn.Module) -> bool:
    """Whether :func:`decode_layer_step` computes ``layer``'s decode step (else the loop calls the layer).

    Only a stock Qwen3 / Qwen2 / Llama decoder layer in eval mode whose modules carry no forward hooks and no
    per-instance ``forward`` (FSDP2's wrapped classes, ``kernels``' kernelized forwards and the like all fail the
    check and keep HF's call); a peft LoRA adapter on a projection is fine (the projections are called as modules).
    """
    parts = _DIRECT_LAYER_PARTS.get(type(layer).__name__)
    if parts is None or layer.training:
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    norms += [getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name)]
    if (type(attention).__name__, type(mlp).__name__) != parts[:2]:
        return False
    if any(type(norm).__name__ != parts[2] for norm in norms):
        return False
    if getattr(attention, "sliding_window", None) is not None or attention.config._attn_implementation != "sdpa":
        return False
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or getattr(torch_module, "_global_forward_hooks_always_called", None)):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
                   for m in (layer, attention, mlp, *norms))


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # Qwen3RMSNorm / Qwen2RMSNorm / LlamaRMSNorm.forward, op for op
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decode_layer_step(layer: Any, hidden: torch.Tensor, mask: torch.Tensor | None,
                      rope: tuple[torch.Tensor, torch.Tensor], cache: Any) -> torch.Tensor:
    """One decode step (one new token per row; or a chunk of new tokens per row under a 4-D ``mask``, as the multi-turn
    loop runs an environment's answer onto its cache) through a Qwen3 / Qwen2 / Llama decoder layer
    (:func:`direct_decode_layer`): the same tensor ops in the same order as the layer's HF forward (transformers
    5.x ``Qwen3DecoderLayer`` / ``Qwen3Attention`` / ``Qwen3MLP`` / ``Qwen3RMSNorm`` / ``apply_rotary_pos_emb``;
    the attention itself is HF's ``sdpa_attention_forward``), so the same values to the bit
    (tests/llm/test_loading.py), without the per-call wrappers around them (module calls, keyword
    deprecation and kernel-hub dispatch): about a fifth of a layer's time at the tiny text LM's width."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention = layer.self_attn
    residual = hidden
    normed = _rms_norm(layer.input_layernorm, hidden)
    shape = (*normed.shape[:-1], -1, attention.head_dim)
    query = attention.q_proj(normed).view(shape)
    key = attention.k_proj(normed).view(shape)
    if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head
        query, key = _rms_norm(attention.q_norm, query), _rms_norm(attention.k_norm, key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = attention.v_proj(normed).view(shape).transpose(1, 2)
    cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
    query = (query * cos) + (_rotate_half(query) * sin)
    key = (key * cos) + (_rotate_half(key) * sin)
    key, value = cache.update(key, value, attention.layer_idx)
    out, _ = sdpa_attention_forward(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling,
                                    sliding_window=None)
    out = attention.o_proj(out.reshape(*normed.shape[:-1], -1).contiguous())
    hidden = residual + out
    residual = hidden
    normed = _rms_norm(layer.post_attention_layernorm, hidden)
    mlp = layer.mlp
    return residual + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))

# generation-config fields the lean loop reproduces, that the engine's call sets itself, or that do not change what
# is sampled; any other field away from its default (repetition_penalty, num_beams, min_length, a static or compiled
# cache, ...) leaves the decoding to HF generate
_LEAN_GENERATION_FIELDS = frozenset({
    "do_sample", "temperature", "top_p", "top_k", "suppress_tokens", "eos_token_id", "pad_token_id", "use_cache",
    "max_new_tokens", "max_length", "num_return_sequences", "min_new_tokens", "bos_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "transformers_version", "_from_model_config"})
_LEAN_MODEL_CLASSES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "LlamaForCausalLM")


def lean_decode_blocker(model: Any, inputs: Mapping[str, Any], *, do_sample: bool, max_new_tokens: int) -> str | None:
    """Why :meth:`HFGenerateEngine._lean_decode` cannot decode this call (then HF ``generate`` does), or None.

    It covers: sampling after :meth:`HFGenerateEngine._prefill` (G > 1) on a Qwen2.5-VL (Qwen-VL RoPE offsets
    set) or a Qwen2 / Qwen3 / Llama text LM, with sdpa attention and full-attention layers, a DynamicCache, and a
    generation config with no field set outside :data:`_LEAN_GENERATION_FIELDS`. Greedy decoding, single
    samples, other models (Qwen2-VL, Qwen3-VL, ...) go to HF. An FSDP2-sharded model decodes here too, on the weights
    :func:`mmpo.vlm.fsdp.full_weights` gathered for the whole rollout (no collective call per token).
    """
    if not do_sample:
        return "greedy"
    cache = inputs.get("cache")
    if cache is None:
        return "no prefilled cache (one sample per prompt, prefill_once=False or a one-token prompt)"
    # under FSDP2 the model's class is FSDP<name>(FSDPModule, <name>): the class it wraps decides
    model_class = next(cls for cls in type(model).__mro__ if not cls.__name__.startswith("FSDP"))
    if model_class.__name__ not in _LEAN_MODEL_CLASSES:
        return f"model class {type(model).__name__}"
    if type(cache) is not DynamicCache:
        return f"cache {type(cache).__name__}"
    text_config = model.config.get_text_config()
    if text_config._attn_implementation != "sdpa":
        return f"attention {text_config._attn_implementation}"
    if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or ()):
        return "sliding-window layers"
    if hasattr(model.model, "language_model") and getattr(model.model, "rope_deltas", None) is None:
        return "no RoPE offsets"
    if max_new_tokens < 1:
        return f"max_new_tokens {max_new_tokens}"
    defaults = GenerationConfig().to_dict()
    for key, value in model.generation_config.to_dict().items():
        default = defaults.get(key)
        if key not in _LEAN_GENERATION_FIELDS and value != default and (value or default):
            return f"generation_config.{key}={value!r}"
    return None


class _GrowingKVCache:
    """A prefilled ``DynamicCache``'s keys and values, each row repeated ``copies`` times (as
    ``batch_repeat_interleave`` would), copied once into buffers with room for ``extra`` tokens, then appended to
    in place (DynamicCache appends by ``torch.cat``, copying each layer's whole cache at every step). The buffers
    are all the decode keeps: (rows x copies, kv heads, prompt + ``extra``, head dim) per layer for keys and for
    values. Only ``update`` exists: the text decoder's attention layers are all that use it."""

    def __init__(self, cache: DynamicCache, extra: int, *, copies: int = 1) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        for layer in cache.layers:
            for source, buffers in ((layer.keys, self.keys), (layer.values, self.values)):
                rows, heads, length, dim = source.shape
                buffer = source.new_empty((rows * copies, heads, length + extra, dim))
                buffer[:, :, :length].unflatten(0, (rows, copies)).copy_(source.unsqueeze(1))
                buffers.append(buffer)
            self.lengths.append(layer.keys.shape[2])

    @property
    def length(self) -> int:
        """Positions held (every layer holds the same number between forwards)."""
        return self.lengths[0]

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` more positions (the buffers grow, at least doubling, when they are short)."""
        for buffers in (self.keys, self.values):
            for index, buffer in enumerate(buffers):
                need = self.lengths[index] + extra
                if buffer.shape[2] < need:
                    grown = buffer.new_empty((*buffer.shape[:2], max(need, 2 * buffer.shape[2]), buffer.shape[3]))
                    grown[:, :, :self.lengths[index]] = buffer[:, :, :self.lengths[index]]
                    buffers[index] = grown

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), e.g. the trajectories still running."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.keys[0].device)
        self.keys = [buffer.index_select(0, index) for buffer in self.keys]
        self.values = [buffer.index_select(0, index) for buffer in self.values]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.lengths[layer_idx]
        end = self.lengths[layer_idx] = start + key_states.shape[2]
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]


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
    keys = list(dict.fromkeys(key for r in rollouts for key in r.extras))
    for key in keys:
        missing = [i for i, r in enumerate(rollouts) if key not in r.extras]
        if missing:
            raise ValueError(f"concat_rollouts: extras[{key!r}] is missing from rollout(s) {missing} of "
                             f"{len(rollouts)}; every rollout must carry the same extras")
        values = [r.extras[key] for r in rollouts]
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
