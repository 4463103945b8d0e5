"""Rollouts with vLLM, colocated in the trainer process (the ``rollout_engine: vllm`` backend).

:class:`VLLMEngine` has :class:`~mmpo.vlm.rollout.HFGenerateEngine`'s contract, ``generate(rows, ...) ->
Rollout``, for both model kinds of :func:`mmpo.vlm.factory.model_kind`: the same prompts (``encode_prompts``:
chat template, qwen-vl-utils resize, the processor's pixel budget; vLLM's own prompt token ids are checked
equal to ours, row by row; a text-only LM's prompts are the tokenizer's chat template, handed to vLLM as
those token ids), ``num_samples``
completions per prompt seeded from torch's RNG (so GRPO's per-step seed fixes them), vision special tokens
never sampled (vLLM's ``allowed_token_ids``: every id but those, a -inf mask before temperature and top-p),
and with ``return_log_probs`` the sampled tokens' log-probs under the distribution they were drawn from
(vLLM's ``processed_logprobs``: after the mask, temperature and top-p, as the HF engine records them) in
``extras["engine_log_probs"]``.

The vLLM engine lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's colocate mode), is
built on the first ``generate`` from ``model_path``, and is given the policy's weights whenever they
changed since the last sync: every optimizer step bumps the parameters' version counters, so the first
``generate`` after a step pushes the weights (``reload_weights`` on the worker, then the encoder,
multimodal and prefix caches are reset: a stale vision embedding would otherwise be reused). Between
steps nothing samples, so this is the same as syncing after every optimizer step, without a sync per
minibatch when ``mu`` or ``minibatch_size`` make several steps per batch.

vLLM is optional: this module imports it only when the engine is built (docs/vllm.md: the CPU install).
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import torch

from mmpo.vlm.factory import is_text_processor, pixel_budget, turn_end_token_id
from mmpo.vlm.processing import build_messages, default_system_prompt, encode_prompts, repeat_rows, vision_token_ids
from mmpo.vlm.rollout import Rollout, _cut_by, completion_mask_from_ids

# vLLM's CPU backend: a small KV cache (its default takes a share of the machine's memory), no thread
# pinning (the trainer shares the cores), and the engine core in this process (weights reachable).
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
COLOCATE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class TurnSample(NamedTuple):
    """One model turn drawn by :meth:`VLLMEngine.continue_token_ids`."""

    tokens: list[int]
    """The tokens drawn, through the first turn-end token."""
    log_probs: list[float]
    """Their log-probs under the distribution they were drawn from."""
    top: list[dict[int, float]]
    """Per position, ``{token: log-prob}`` of the most likely tokens and the sampled one (empty unless asked)."""
    cached_tokens: int = 0
    """Context tokens whose KV vLLM's prefix cache served (whole KV blocks: 128 tokens on the CPU backend); the rest
    of the context was prefilled."""


def vllm_available() -> bool:
    """Whether ``import vllm`` would find a package (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@contextmanager
def _rng_untouched() -> Iterator[None]:
    """vLLM seeds python's, numpy's and torch's global RNGs when it builds its worker: the trainer's
    streams are restored afterwards, so the choice of engine does not shift e.g. minibatch shuffles."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class VLLMEngine:
    """Sampling with a colocated vLLM ``LLM`` whose weights follow the trained policy.

    Args:
        model: the trained HF policy (a Qwen-VL ``...ForConditionalGeneration`` or a text-only
            ``...ForCausalLM``); its weights are pushed to vLLM after it changes. Kept as ``engine.model`` for
            code that scores with it.
        processor: its processor (``load_vlm``'s: a VLM's with its pixel budget set, or a text LM's
            :class:`~mmpo.vlm.factory.TextProcessor`).
        model_path: the directory the policy was loaded from (vLLM builds its copy from it).
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT``.
        max_prompt_length: refuse longer prompts (never truncated).
        dtype: vLLM's weights dtype ("float32" on CPU, as the trainer's; "bfloat16" on GPU).
        max_model_len: prompt + completion tokens per sequence vLLM plans for.
        max_num_batched_tokens: tokens per vLLM scheduler step; at least the prompt tokens of one ``generate``
            call (vLLM's CPU backend cannot split a seeded prefill over steps: "CPU Generator does not use
            offset").
        gpu_memory_utilization: vLLM's share of the GPU (on a GPU; the trainer needs the rest).
        max_images_per_prompt: a VLM's images per request at most (vLLM's ``limit_mm_per_prompt``): a multi-turn
            request holds its prompt's images and every image the tools answered with so far.
        engine_kwargs: further ``vllm.LLM`` arguments.
    """

    def __init__(self, model: Any, processor: Any, *, model_path: str, system_prompt: str | None = "default",
                 max_prompt_length: int | None = None, dtype: str = "float32", max_model_len: int = 4096,
                 max_num_batched_tokens: int = 16384, gpu_memory_utilization: float = 0.3,
                 max_images_per_prompt: int = 8, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        if max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}): a prompt is prefilled in one scheduler step")
        self.model = model
        self.processor = processor
        self.model_path = str(model_path)
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.engine_kwargs = dict(engine_kwargs or {})
        tokenizer = processor.tokenizer
        self.text_only = is_text_processor(processor)
        self.eos_token_id = turn_end_token_id(tokenizer)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.forbidden_ids = vision_token_ids(processor)
        self.max_images_per_prompt = max_images_per_prompt
        self.llm: Any = None
        self._synced_version: int | None = None
        self.num_syncs = 0  # weight pushes so far (tests and logs read it)

    # ------------------------------------------------------------------ engine and weights

    def _weights_version(self) -> int:
        """Sum of the parameters' in-place version counters: it grows with every optimizer step (and with
        ``load_state_dict``, e.g. a resumed checkpoint), so an unchanged sum means vLLM's copy is current."""
        return sum(int(p._version) for p in self.model.parameters())

    def _allowed_token_ids(self) -> list[int] | None:
        """Every id of the output layer but the vision special tokens and the model's own suppressed ids;
        None (no restriction) when nothing is banned, as the HF engine's ``suppress_tokens`` is then None
        (a text-only LM without configured ``suppress_tokens``)."""
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        configured = getattr(getattr(self.model, "generation_config", None), "suppress_tokens", None) or []
        banned = set(self.forbidden_ids) | {int(i) for i in configured}
        if not banned:
            return None
        return [i for i in range(vocab) if i not in banned]

    def _build(self) -> None:
        for key, value in COLOCATE_ENVIRONMENT.items():
            if os.environ.get(key, value) != value:
                raise RuntimeError(f"the colocated vLLM engine needs {key}={value} (set: {os.environ[key]!r}): "
                                   "its weights are updated in this process")
            os.environ[key] = value
        device = next(self.model.parameters()).device
        if device.type == "cpu":
            for key, value in CPU_ENVIRONMENT.items():
                os.environ.setdefault(key, value)
        from vllm import LLM

        multimodal: dict[str, Any] = {}
        if not self.text_only:  # the processor's pixel budget, so vLLM resizes images as the trainer does
            min_pixels, max_pixels = pixel_budget(self.processor)
            multimodal = {"limit_mm_per_prompt": {"image": self.max_images_per_prompt, "video": 0},
                          "mm_processor_kwargs": {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}}
        threads = torch.get_num_threads()  # vLLM lowers torch's thread count for serving: the trainer keeps its own
        with _rng_untouched():
            self.llm = LLM(
                model=self.model_path, dtype=self.dtype, seed=0, enforce_eager=True,
                max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                gpu_memory_utilization=self.gpu_memory_utilization, logprobs_mode="processed_logprobs",
                generation_config="vllm",  # sampling settings come from here, not the model's generation_config
                **multimodal,
                **self.engine_kwargs,
            )
        torch.set_num_threads(threads)
        self._allowed = self._allowed_token_ids()
        # vLLM loaded model_path; the policy may already differ from it (a resumed run): sync on first use
        self._synced_version = None

    def sync_weights(self) -> None:
        """Push the policy's current weights into vLLM (in place) and drop every cache built from the old ones."""
        if self.llm is None:
            self._build()
        named = ((name, tensor.detach()) for name, tensor in self.model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.llm.reset_mm_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        self._synced_version = self._weights_version()
        self.num_syncs += 1

    def _ensure_current(self) -> None:
        if self.llm is None:
            self._build()
        if self._synced_version != self._weights_version():
            self.sync_weights()

    # ------------------------------------------------------------------ sampling

    def _vllm_prompts(self, rows: Sequence[Mapping[str, Any]],
                      prompts: Mapping[str, torch.Tensor] | None = None) -> list[dict[str, Any]]:
        """The prompts of :func:`encode_prompts` (same messages, chat template, prefix and resized images).

        A text-only LM's prompts are ``prompts``' own token ids (the tokenizer's chat template, encoded by
        :func:`encode_prompts`; computed here when not given): vLLM would tokenize text again with special
        tokens added (a second BOS on Llama). A VLM's are the text and the images, which vLLM's processor
        expands into image placeholders itself.
        """
        if self.text_only:
            if prompts is None:
                prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                         max_prompt_length=self.max_prompt_length)
            return [{"prompt_token_ids": ids[mask > 0].tolist()}
                    for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
        prompts = []
        for row, (messages, images) in zip(rows, self._messages_and_images(rows)):
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text += row.get("assistant_prefix") or ""
            prompt: dict[str, Any] = {"prompt": text}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return prompts

    def _messages_and_images(self, rows: Sequence[Mapping[str, Any]]) -> list[tuple[list[dict[str, Any]], list[Any]]]:
        """Each row's chat messages (:func:`build_messages`) and its images resized as :func:`encode_prompts` resizes
        them (qwen-vl-utils within the processor's pixel budget), in the order of their placeholders."""
        from qwen_vl_utils import process_vision_info

        system_prompt = default_system_prompt() if self.system_prompt == "default" else self.system_prompt
        min_pixels, max_pixels = pixel_budget(self.processor)
        patch_size = int(getattr(self.processor.image_processor, "patch_size", 14))
        out = []
        for row in rows:
            messages = build_messages(row, system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels)
            out.append((messages, process_vision_info([messages], image_patch_size=patch_size)[0] or []))
        return out

    def prompt_images(self, rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
        """A VLM's prompt images per row (resized, in placeholder order): the first images of a multi-turn request."""
        return [images for _, images in self._messages_and_images(rows)]

    def _collapsed(self, context: Sequence[int], images: Sequence[Any]) -> list[int]:
        """A VLM's context as vLLM takes it: each image's run of ``<|image_pad|>`` tokens (one per merged patch, as
        the trainer's processor expanded it) back to one placeholder, which vLLM's processor expands again from the
        image it is handed. The number of runs must equal the number of images."""
        pad = int(self.model.config.image_token_id)
        out: list[int] = []
        for token in context:
            if not (token == pad and out and out[-1] == pad):
                out.append(int(token))
        runs = out.count(pad)
        if runs != len(images):
            raise ValueError(f"a context holds {runs} image placeholders but {len(images)} images were given")
        return out

    @torch.no_grad()
    def continue_token_ids(self, contexts: Sequence[Sequence[int]], max_tokens: Sequence[int], *,
                           images: Sequence[Sequence[Any]] | None = None, temperature: float = 1.0,
                           top_p: float = 1.0, do_sample: bool = True, top_logprobs: int = 0) -> list[TurnSample]:
        """One turn for each of ``contexts`` (token ids as the trainer holds them: prompt and conversation so far,
        each a request of its own with ``max_tokens[i]`` new tokens at most): the tokens drawn, through the first
        turn-end token, and their log-probs (the sampled distribution's, as :meth:`generate`'s). vLLM's prefix cache
        keeps the KV of a context's earlier turns (whole KV blocks), so only the rest is prefilled
        (:attr:`TurnSample.cached_tokens`). Sampling seeds: one per request from torch's global RNG.

        A VLM's ``images[i]``: context ``i``'s images (resized PIL images: the prompt's, then the tool answers'), in
        the order of their placeholders; each run of image placeholder tokens goes to vLLM as one placeholder
        (:meth:`_collapsed`) with the images as ``multi_modal_data``, and vLLM's expanded prompt is checked equal to
        the context, token for token.

        ``top_logprobs`` > 0: each position's ``top_logprobs`` most likely tokens under the sampled distribution and
        the sampled token's, ``{token: log-prob}`` (vLLM's ``logprobs=k``), in :attr:`TurnSample.top` (ARPO's entropy
        probe)."""
        from vllm import SamplingParams

        if self.text_only and images is not None and any(images):
            raise ValueError("VLLMEngine: images given for a text-only LM's contexts")
        if not self.text_only and (images is None or len(images) != len(contexts)):
            raise ValueError("VLLMEngine: a VLM's multi-turn contexts need their images (one list per context)")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        longest = max(len(c) + m for c, m in zip(contexts, max_tokens))
        if longest > self.max_model_len:
            raise ValueError(f"a conversation of {longest} tokens > the vLLM engine's max_model_len "
                             f"{self.max_model_len}: raise vllm_max_model_len")
        requests: list[dict[str, Any]] = []
        for index, context in enumerate(contexts):
            if self.text_only or not images[index]:
                requests.append({"prompt_token_ids": self._collapsed(context, []) if not self.text_only
                                 else list(map(int, context))})
                continue
            if len(images[index]) > self.max_images_per_prompt:
                raise ValueError(f"a conversation holds {len(images[index])} images > the vLLM engine's "
                                 f"{self.max_images_per_prompt} per prompt (fewer max_turns, or max_images_per_prompt)")
            requests.append({"prompt_token_ids": self._collapsed(context, images[index]),
                             "multi_modal_data": {"image": list(images[index])}})
        self._ensure_current()
        seeds = torch.randint(0, 2**31 - 1, (len(contexts),)).tolist()
        common = dict(n=1, stop_token_ids=[self.eos_token_id], ignore_eos=True, allowed_token_ids=self._allowed,
                      logprobs=int(top_logprobs), skip_special_tokens=True, detokenize=False)
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=0, seed=int(seed), max_tokens=int(m),
                                 **common) if do_sample else SamplingParams(temperature=0.0, max_tokens=int(m), **common)
                  for seed, m in zip(seeds, max_tokens)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = []
        for context, output in zip(contexts, outputs):
            if list(output.prompt_token_ids) != list(map(int, context)):
                raise RuntimeError(f"vLLM's expanded prompt differs from the trainer's context "
                                   f"({len(output.prompt_token_ids)} vs {len(context)} tokens)")
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            log_probs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
            end = len(tokens)
            if self.eos_token_id in tokens:
                end = tokens.index(self.eos_token_id) + 1
            cut = next((k for k, token in enumerate(tokens[:end]) if token in self.forbidden_ids), None)
            if cut is not None:  # never drawn (not allowed); should one be, it cuts the turn, as the HF engine does
                end = cut
            top = [{int(token): float(entry.logprob) for token, entry in step.items()}
                   for step in completion.logprobs[:end]] if top_logprobs else []
            out.append(TurnSample(tokens[:end], log_probs[:end], top, int(output.num_cached_tokens or 0)))
        return out

    @torch.no_grad()
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
        logits_processors: Sequence[Any] = (),
    ) -> Rollout:
        """Sample ``num_samples`` completions for every row; groups are contiguous (HFGenerateEngine's contract).

        Each prompt's seed is drawn from torch's global RNG (seed it, or wrap in ``fork_rng``, as GRPO does
        per step); its ``num_samples`` samples use that seed + 0, 1, ... (vLLM's parallel sampling).
        ``logits_processors`` (HF ``LogitsProcessor`` objects, e.g. HAPO's per-token temperature) have no
        vLLM counterpart here: they are refused (use ``rollout_engine: hf``).
        """
        from vllm import SamplingParams

        if logits_processors:
            raise ValueError("VLLMEngine: HF logits_processors (e.g. HAPO's per-token temperature) do not run in "
                             "vLLM; use rollout_engine: hf for this algorithm")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        rows = list(rows)
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=self.max_prompt_length)
        lengths = prompts["attention_mask"].sum(-1)
        if int(lengths.max()) + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) > the vLLM "
                             f"engine's max_model_len {self.max_model_len}: raise vllm_max_model_len")
        if int(lengths.sum()) > self.max_num_batched_tokens:
            raise ValueError(f"the step's prompts hold {int(lengths.sum())} tokens > vllm_max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} (vLLM's CPU backend cannot split seeded prefills)")
        self._ensure_current()
        copies = num_samples if do_sample else 1  # greedy samples are identical: decode once, repeat below
        seeds = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()
        common = dict(n=copies, max_tokens=max_new_tokens, stop_token_ids=[self.eos_token_id], ignore_eos=True,
                      allowed_token_ids=self._allowed, logprobs=0 if return_log_probs else None,
                      skip_special_tokens=True, detokenize=False)
        if do_sample:
            params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=0, seed=int(seed), **common)
                      for seed in seeds]
        else:
            params = [SamplingParams(temperature=0.0, **common) for _ in rows]
        outputs = self.llm.generate(self._vllm_prompts(rows, prompts), params, use_tqdm=False)
        ids = prompts["input_ids"]
        sequences: list[list[int]] = []
        log_probs: list[list[float]] = []
        for index, output in enumerate(outputs):
            ours = ids[index][prompts["attention_mask"][index] > 0].tolist()
            if list(output.prompt_token_ids) != ours:
                raise RuntimeError(f"row {rows[index].get('id', index)!r}: vLLM's prompt token ids differ from the "
                                   f"trainer's ({len(output.prompt_token_ids)} vs {len(ours)} tokens)")
            completions = sorted(output.outputs, key=lambda c: c.index)
            if len(completions) != copies:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt, expected {copies}")
            for completion in completions:
                tokens = list(completion.token_ids)
                sequences.append(tokens)
                if return_log_probs:
                    log_probs.append([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
        width = max(1, max(len(tokens) for tokens in sequences))
        completion_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        engine_log_probs = torch.zeros(len(sequences), width)
        for index, tokens in enumerate(sequences):
            completion_ids[index, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if return_log_probs:
                engine_log_probs[index, : len(tokens)] = torch.tensor(log_probs[index], dtype=torch.float32)
        if not do_sample:
            completion_ids = completion_ids.repeat_interleave(num_samples, dim=0)
            engine_log_probs = engine_log_probs.repeat_interleave(num_samples, dim=0)
        completion_mask = completion_mask_from_ids(completion_ids, eos_token_id=self.eos_token_id,
                                                   forbidden_ids=self.forbidden_ids)
        extras: dict[str, Any] = {
            "vision_cut": _cut_by(completion_ids, eos_token_id=self.eos_token_id, forbidden_ids=self.forbidden_ids)}
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.pad_token_id)
        texts = self.processor.batch_decode(completion_ids, skip_special_tokens=True)
        if return_log_probs:
            extras["engine_log_probs"] = engine_log_probs.masked_fill(completion_mask == 0, 0.0)
        group_ids = torch.arange(len(rows)).repeat_interleave(num_samples)
        return Rollout(
            rows=[rows[i] for i in group_ids.tolist()],
            group_ids=group_ids,
            prompt_inputs=repeat_rows(prompts, num_samples),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            texts=texts,
            extras=extras,
        )
