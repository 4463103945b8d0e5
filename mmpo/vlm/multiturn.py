"""Multi-turn rollouts: model turns interleaved with environment (tool) responses, as one completion.

A trajectory is the prompt, then turns: the model's message (ending with its turn-end token), the
environment's answer rendered by the chat template (``<|im_end|>``-closed tool / user messages and the
next ``<|im_start|>assistant\\n``), the model's next message, ... until the environment says done (tool
use: a message without a tool call), ``max_turns`` model turns, or ``max_total_tokens`` completion tokens.

The result is an ordinary :class:`~mmpo.vlm.rollout.Rollout`, so every estimator and loss applies
unchanged: ``prompt_inputs`` the first prompt, ``completion_ids`` every token after it (model and
environment), grouped contiguously by prompt, and

- ``completion_mask`` (N, T): 1 on the model's tokens only; 0 on the environment's tokens (holes) and pad;
- ``extras["completion_attention_mask"]`` (N, T): 1 on every real token: the attention mask of the
  training forward (:func:`completion_attention_mask`), so a model token is scored in exactly the context
  it was sampled in, environment tokens included;
- ``extras["engine_log_probs"]`` (N, T): the sampled tokens' log-probs as the sampler drew them, 0 in holes;
- ``extras["turns"]``, ``extras["tool_calls"]`` (N,) long, ``extras["env_rewards"]`` (N,) float (the sum of
  the environment's step rewards); ``texts``: each trajectory's last model message (what reward functions see).

Decoding, ``schedule="continuous"`` (the default): continuous batching across turns. Each prompt but its last token is
prefilled once for its G trajectories (:meth:`~mmpo.vlm.rollout.HFGenerateEngine._prefill`, images encoded once); then
every step feeds each running trajectory's new tokens and draws its next token. A trajectory in the middle of a turn
feeds its last sampled token; one whose turn just ended is stepped by its environment at once (the trajectories whose
turns ended at that step form one batch: a tool sandbox runs their calls together) and feeds, in the same step, its
turn's last token and the environment's answer (images included: their features replace the placeholders), then
draws its next turn's first token, while the others go on decoding. The answers go through one forward over just the
rows starting a turn at that step (right-padded to the longest answer), so every decode step stays one token wide;
each row writes its keys at its own next cache positions (:class:`_RowCache`), so pad columns are never attended and
a row's cache has no holes past its prompt; each token keeps the position the training forward gives it
(a text LM: its count of real tokens before it; Qwen-VL: ``get_rope_index`` over the row's real sequence where an
answer brings images, then +1 a token). Finished trajectories' rows are dropped. Each layer runs as the engine's lean
loop runs it (:func:`~mmpo.vlm.rollout.decode_layer_step`, HF's ops without the module wrappers, where the layer allows;
for an answer's chunk too), and when every running row starts a turn at one step the answers' forward runs over the
cache in place rather than over a gathered copy of its rows. The sampling is HF ``_sample``'s
(vision tokens suppressed, EOS before ``min_new_tokens`` within a turn, temperature, top-p, ``multinomial``;
``argmax`` when greedy), so the decoder runs 1 + (the longest trajectory's model tokens) sequential steps, against
the sum over turns of each turn's longest in the turn-synchronous schedule. Greedy decoding gives the
turn-synchronous schedule's tokens, masks and log-probs, and one sampled trajectory its tokens from the same RNG state
(tests/agents/test_continuous_batching.py); with several trajectories the RNG draws come in another order.
It applies wherever the engine's lean loop covers the model (:func:`~mmpo.vlm.rollout.lean_decode_blocker`: Qwen2.5-VL,
Qwen2 / Qwen3 / Llama text LMs with sdpa attention and a generation config it reproduces); elsewhere, or with
``schedule="turns"``, the turn-synchronous schedule below runs (``last_schedule`` says which ran, and why).

Decoding, ``schedule="turns"``: every turn of the batch decodes until its longest trajectory's turn ends.
The first turn goes through the engine's own :meth:`~mmpo.vlm.rollout.HFGenerateEngine.generate`
(each prompt prefilled once for its G samples, the lean decoding loop where it applies), which leaves its KV cache
(``keep_cache``). Each later turn keeps that cache (:class:`_KeptCache`): only the turn's new tokens (the previous
turn's last token, which the loop never fed, and the environment's answer, images included) run through the text
decoder onto each trajectory's cache row, and the lean loop decodes from there; rows of finished trajectories are
dropped. Rows share one cache length, so a row's positions after its own turn ended, and the left padding of a
shorter answer, are holes its attention mask hides; each token keeps the position the training forward gives it
(a text LM: its count of real tokens before it; Qwen-VL: ``get_rope_index`` over the row's real sequence). Where the
lean loop does not apply (greedy decoding, models it does not cover) or ``keep_cache=False``, each later turn
re-prefills the whole conversation so far (``model.generate`` on the left-padded contexts). Both draw the same
tokens with the same log-probs from the same RNG state (tests/agents/test_kv_cache.py).

On the vLLM engine (:class:`~mmpo.vlm.vllm_engine.VLLMEngine`, ``last_schedule == "vllm"``): every turn of the running
trajectories is one vLLM call (:meth:`MultiTurnEngine._vllm_turn`), each trajectory a request with its prompt and
conversation so far as token ids and, for a VLM, its images (the prompt's, then the environment answers', resized as
:func:`encode_observation` resizes them); vLLM's prefix cache holds the earlier turns' KV (whole blocks). Greedy
decoding gives the HF engine's tokens (tests/llm/test_vllm_multiturn.py, tests/vlm/test_vllm_multiturn.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from mmpo.tools.env import Environment, ToolEnvironment
from mmpo.tools.functions import tool_system_prompt
from mmpo.vlm.continuation import extend_prompts
from mmpo.vlm.fsdp import full_weights
from mmpo.vlm.processing import (append_row_images, default_system_prompt, encode_prompts, model_inputs,
                                 repeat_rows, select_rows)
from mmpo.vlm.rollout import (HFGenerateEngine, Rollout, _SampledLogProbRecorder, completion_attention_mask,  # noqa: F401
                              completion_mask_from_ids, decode_layer_step, direct_decode_layer, lean_decode_blocker)

_TURN_SENTINEL = "\u2063MMPO_TURN\u2063"


def _turn_end_text(processor: Any) -> str:
    """The turn-end token's text (``<|im_end|>`` for Qwen); the lookup copies the tokenizer's vocabulary."""
    return processor.tokenizer.convert_ids_to_tokens(_turn_end_id(processor))


def _observation_text(processor: Any, messages: Sequence[Mapping[str, Any]], end_text: str | None = None) -> str:
    end_text = _turn_end_text(processor) if end_text is None else end_text
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _TURN_SENTINEL}]
    text = processor.apply_chat_template([*base, *[dict(m) for m in messages]], tokenize=False,
                                         add_generation_prompt=True)
    anchor = text.find(_TURN_SENTINEL + end_text)
    if anchor < 0:
        raise ValueError(f"the chat template does not close an assistant message with {end_text!r}; "
                         "multi-turn rollouts need the turn-end token after each assistant message")
    return text[anchor + len(_TURN_SENTINEL) + len(end_text):]


def observation_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The images of an environment answer (``{"type": "image", "image": PIL}`` items of list contents), in order."""
    return [item["image"] for message in messages if isinstance(message.get("content"), list)
            for item in message["content"] if isinstance(item, Mapping) and item.get("type") == "image"]


def observation_token_ids(processor: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens that follow a model turn's end token when the chat template renders ``messages`` (the
    environment's answer) after it, through the next assistant header.

    Found by rendering a conversation whose assistant message is a sentinel, with and without ``messages``
    and the generation prompt, and taking the text after the sentinel's turn end: whatever the template writes
    between turns (newlines, ``<|im_start|>tool`` / ``user``, ``<tool_response>`` wrappers) is kept exactly.
    An answer with images: :func:`encode_observation` (it expands each image's placeholder)."""
    return encode_observation(processor, messages)[0]


def encode_observation(processor: Any, messages: Sequence[Mapping[str, Any]], *, end_text: str | None = None
                       ) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """An environment answer -> its tokens and its images as ``[(pixel_values (patches, D), grid (3,))]``.

    Text: :func:`observation_token_ids`' tokens. Images (a VLM's tool answer, e.g. a zoomed crop) are resized
    as prompt images are (qwen-vl-utils within the processor's pixel budget) and their placeholders expanded
    by the processor to one ``<|image_pad|>`` per merged patch: in the context as vision tokens, out of the loss
    like every environment token. A text-only LM's processor refuses images (ValueError).

    ``end_text``: the turn-end token's text (:func:`_turn_end_text`, looked up when None); a caller encoding several
    answers looks it up once (the lookup copies the tokenizer's vocabulary, about as long as rendering the answer)."""
    suffix = _observation_text(processor, messages, end_text)
    images = observation_images(messages)
    if not images:
        return list(processor.tokenizer(suffix, add_special_tokens=False)["input_ids"]), []
    from mmpo.vlm.factory import is_text_processor

    if is_text_processor(processor):
        raise ValueError("the environment answered with an image, but the policy is a text-only LM; image tools "
                         "(e.g. image_zoom_in_tool) need a VLM")
    encoded = processor(text=[suffix], images=resized_images(processor, images), return_tensors="pt")
    grid = encoded["image_grid_thw"]
    sizes = grid.prod(-1).tolist()
    chunks = torch.split(encoded["pixel_values"], [int(n) for n in sizes], 0)
    return encoded["input_ids"][0].tolist(), [(chunk, thw) for chunk, thw in zip(chunks, grid)]


def encode_observations(processor: Any, observations: Sequence[Sequence[Mapping[str, Any]]], *,
                        end_text: str | None = None) -> list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]]:
    """:func:`encode_observation` of each answer in ``observations``; the text-only answers' rendered text goes through
    the tokenizer in one call (the same tokens as one call each: no padding, no special tokens added)."""
    end_text = _turn_end_text(processor) if end_text is None else end_text
    out: list[Any] = [None] * len(observations)
    texts: dict[int, str] = {}
    for index, messages in enumerate(observations):
        if observation_images(messages):
            out[index] = encode_observation(processor, messages, end_text=end_text)
        else:
            texts[index] = _observation_text(processor, messages, end_text)
    if texts:
        encoded = processor.tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"]
        for index, ids in zip(texts, encoded):
            out[index] = (list(ids), [])
    return out


def resized_images(processor: Any, images: Sequence[Any]) -> list[Any]:
    """Environment-answer images resized as prompt images are (qwen-vl-utils ``fetch_image`` within the processor's
    pixel budget): what the processor encodes (:func:`encode_observation`) and what the vLLM engine is handed."""
    from qwen_vl_utils import fetch_image

    from mmpo.vlm.factory import pixel_budget

    min_pixels, max_pixels = pixel_budget(processor)
    patch = int(getattr(processor.image_processor, "patch_size", 14))
    return [fetch_image({"image": image, "min_pixels": min_pixels, "max_pixels": max_pixels}, image_patch_size=patch)
            for image in images]


def _transcript_content(content: Any) -> str:
    if not isinstance(content, list):
        return str(content)
    parts = []
    for item in content:
        if isinstance(item, Mapping) and item.get("type") == "image":
            parts.append(f"<image {item['image'].size[0]}x{item['image'].size[1]}>")
        elif isinstance(item, Mapping):
            parts.append(str(item.get("text", "")))
    return "".join(parts)


def _turn_end_id(processor: Any) -> int:
    from mmpo.vlm.factory import turn_end_token_id

    return int(turn_end_token_id(processor.tokenizer))


@dataclass
class _Trajectory:
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    env_reward: float = 0.0
    last_message: str = ""
    done: bool = False
    awaiting_environment: bool = False
    transcript: list[dict[str, str]] = field(default_factory=list)
    images: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """The images of the environment's answers so far (``(pixel_values, grid)``), in context order."""
    answer_images: list[Any] = field(default_factory=list)
    """The same images as the environment gave them (PIL), in context order (the vLLM engine resizes and encodes
    them itself)."""
    pending: list[int] = field(default_factory=list)
    """Tokens in the trajectory but not yet in the kept KV cache (the turn's last token, the environment's answer)."""
    pending_images: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """The images of ``pending``."""

    def add(self, tokens: Sequence[int], log_probs: Sequence[float] | None, trained: bool) -> None:
        self.tokens += list(tokens)
        self.trained += [int(trained)] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


class MultiTurnEngine:
    """Multi-turn rollouts over an :class:`HFGenerateEngine` (see the module docstring).

    Args:
        engine: the policy's single-turn engine (model, processor, system prompt, token ids).
        max_turns: model turns per trajectory at most.
        max_total_tokens: completion tokens (model and environment) per trajectory at most; a turn is cut at
            the budget, and an environment answer that does not fit ends the trajectory.
        max_tokens_per_turn: tokens of one model turn at most.
        keep_cache: with ``schedule="turns"``: keep the KV cache across turns where the lean loop decodes (the module
            docstring); False re-prefills the conversation at every turn (the same tokens and log-probs, more compute).
        schedule: ``"continuous"`` (default): continuous batching across turns (the module docstring), wherever the
            engine's lean loop covers the model (:func:`~mmpo.vlm.rollout.lean_decode_blocker`), greedy decoding
            included; elsewhere, and with ``"turns"``, the turn-synchronous schedule: every turn of the batch
            decodes until its longest trajectory's turn ends. ``last_schedule`` says which ran (and why).
    """

    def __init__(self, engine: HFGenerateEngine, *, max_turns: int, max_total_tokens: int,
                 max_tokens_per_turn: int, keep_cache: bool = True, schedule: str = "continuous") -> None:
        if min(max_turns, max_total_tokens, max_tokens_per_turn) < 1:
            raise ValueError("max_turns, max_total_tokens and max_tokens_per_turn must be >= 1")
        if schedule not in ("continuous", "turns"):
            raise ValueError(f"schedule must be 'continuous' or 'turns', got {schedule!r}")
        self.engine = engine
        self.keep_cache = keep_cache
        self.schedule = schedule
        self.last_schedule = ""
        """How the last :meth:`generate` decoded: ``"continuous"``, or ``"turns"`` (``"turns: <why>"`` where the
        continuous schedule was asked for but the lean loop does not cover the model or its generation config)."""
        self.last_prefill_tokens = 0
        """Context tokens the later turns of the last :meth:`generate` ran through the model before decoding (with
        the kept cache: each turn's new tokens only; re-prefilling: each turn's whole conversation; on vLLM: each
        turn's context but the whole KV blocks its prefix cache served)."""
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.last_transcripts: list[list[dict[str, str]]] = []
        """Each trajectory of the last :meth:`generate` as chat messages (for rollout logs)."""

    def generate(self, rows: Sequence[Mapping[str, Any]], envs: Sequence[Environment], *, num_samples: int,
                 temperature: float = 1.0, top_p: float = 1.0, do_sample: bool = True) -> Rollout:
        """``num_samples`` trajectories per row; ``envs`` holds one fresh environment per trajectory
        (``len(rows) * num_samples``, trajectory ``i`` answers row ``i // num_samples``)."""
        rows = list(rows)
        if len(envs) != len(rows) * num_samples:
            raise ValueError(f"{len(envs)} environments for {len(rows)} rows x {num_samples} samples")
        engine = self.engine
        first_messages = [env.reset(rows[i // num_samples]) for i, env in enumerate(envs)]
        prompt_rows = self.tool_prompt_rows(rows, [first_messages[index * num_samples] for index in range(len(rows))],
                                            [envs[index * num_samples].tools for index in range(len(rows))])
        self.last_prefill_tokens = 0
        self.last_schedule = "turns"
        if getattr(engine, "continue_token_ids", None) is not None:  # the vLLM engine
            self.last_schedule = "vllm"
            return self._generate_vllm(prompt_rows, first_messages, envs, num_samples=num_samples,
                                       temperature=temperature, top_p=top_p, do_sample=do_sample)
        if self.schedule == "continuous":
            rollout = self._generate_continuous(prompt_rows, first_messages, envs, num_samples=num_samples,
                                                temperature=temperature, top_p=top_p, do_sample=do_sample)
            if rollout is not None:
                return rollout
        first = engine.generate(prompt_rows, num_samples=num_samples,
                                max_new_tokens=min(self.max_tokens_per_turn, self.max_total_tokens),
                                temperature=temperature, top_p=top_p, do_sample=do_sample, return_log_probs=True,
                                keep_cache=self.keep_cache)
        prompts = first.prompt_inputs
        trajectories = [_Trajectory() for _ in envs]
        for i, trajectory in enumerate(trajectories):
            trajectory.transcript.append({"role": "user", "content": first_messages[i]})
            keep = first.completion_mask[i] > 0
            self._add_turn(trajectory, first.completion_ids[i][keep].tolist(),
                           first.extras["engine_log_probs"][i][keep].tolist())
        kept = None
        if engine.kept_cache is not None:
            kept = _KeptCache.after_first_turn(engine.kept_cache, prompts["attention_mask"], trajectories,
                                               steps=first.completion_ids.shape[1])
            engine.kept_cache = None
        self.last_prefill_tokens = 0
        while True:
            self._step_environments(trajectories, envs)
            active = [i for i, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            if kept is not None:
                self._next_turn_on_cache(kept, trajectories, active, prompts, temperature=temperature, top_p=top_p)
            else:
                self._next_turn(trajectories, active, prompts, temperature=temperature, top_p=top_p,
                                do_sample=do_sample)
        self.last_transcripts = [t.transcript for t in trajectories]
        return self._rollout(first.rows, first.group_ids, first.prompt_inputs, trajectories)

    def start(self, rows: Sequence[Mapping[str, Any]], envs: Sequence[Environment], *, num_samples: int,
              temperature: float = 1.0, top_p: float = 1.0, do_sample: bool = True) -> tuple[Rollout, list[_Trajectory]]:
        """The first model turn of ``num_samples`` trajectories per row (environments reset, not yet stepped), without
        a kept cache: the engine's first-turn rollout (its ``prompt_inputs`` are every later turn's prompts) and the
        trajectories. Tree rollouts (:mod:`mmpo.algos.dialtree`) continue from here with :meth:`_next_turn`."""
        rows = list(rows)
        if len(envs) != len(rows) * num_samples:
            raise ValueError(f"{len(envs)} environments for {len(rows)} rows x {num_samples} samples")
        first_messages = [env.reset(rows[i // num_samples]) for i, env in enumerate(envs)]
        prompt_rows = self.tool_prompt_rows(rows, [first_messages[index * num_samples] for index in range(len(rows))],
                                            [envs[index * num_samples].tools for index in range(len(rows))])
        first = self.engine.generate(prompt_rows, num_samples=num_samples,
                                     max_new_tokens=min(self.max_tokens_per_turn, self.max_total_tokens),
                                     temperature=temperature, top_p=top_p, do_sample=do_sample, return_log_probs=True)
        trajectories = [_Trajectory() for _ in envs]
        for i, trajectory in enumerate(trajectories):
            trajectory.transcript.append({"role": "user", "content": first_messages[i]})
            keep = first.completion_mask[i] > 0
            self._add_turn(trajectory, first.completion_ids[i][keep].tolist(),
                           first.extras["engine_log_probs"][i][keep].tolist())
        return first, trajectories

    def tool_prompt_rows(self, rows: Sequence[Mapping[str, Any]], first_messages: Sequence[str],
                         tools: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Each row with its environment's first message as the problem and its tools' schemas in the system prompt."""
        out = []
        for row, message, schemas in zip(rows, first_messages, tools):
            system = row.get("system_prompt", self.engine.system_prompt)
            system = default_system_prompt() if system == "default" else system
            out.append({**row, "problem": message, "system_prompt": tool_system_prompt(system, schemas)})
        return out

    # ------------------------------------------------------------------ turns

    def _add_turn(self, trajectory: _Trajectory, tokens: list[int], log_probs: list[float], text: str | None = None
                  ) -> None:
        """Add a model turn of ``tokens``; ``text``: their decoded text (decoded here when None)."""
        trajectory.add(tokens, log_probs, trained=True)
        trajectory.turns += 1
        if text is None:
            text = self.engine.processor.batch_decode([tokens], skip_special_tokens=True)[0]
        trajectory.last_message = text
        trajectory.transcript.append({"role": "assistant", "content": text})
        # a finished turn goes to the environment (its reward counts even on the last turn); a turn cut by a
        # token budget ends the trajectory without one
        trajectory.awaiting_environment = bool(tokens) and tokens[-1] == self.engine.eos_token_id
        trajectory.done = not trajectory.awaiting_environment

    def _step_environments(self, trajectories: list[_Trajectory], envs: Sequence[Environment]) -> None:
        waiting = [i for i, t in enumerate(trajectories) if t.awaiting_environment]
        if not waiting:
            return
        messages = [trajectories[i].last_message for i in waiting]
        end_text = _turn_end_text(self.engine.processor)  # once per call, not per answer
        if all(isinstance(envs[i], ToolEnvironment) for i in waiting):
            results = ToolEnvironment.step_batch([envs[i] for i in waiting], messages)
        else:
            results = [envs[i].step(message) for i, message in zip(waiting, messages)]
        answered = []  # the trajectories whose answer goes into the context
        for i, result in zip(waiting, results):
            trajectory = trajectories[i]
            trajectory.awaiting_environment = False
            trajectory.env_reward += float(result.reward)
            trajectory.tool_calls += int(result.info.get("tool_calls", 0))
            if result.done or not result.observation or trajectory.turns >= self.max_turns:
                trajectory.done = True  # the environment is done, or no model turn would follow its answer
                continue
            answered.append((trajectory, result))
        encoded = encode_observations(self.engine.processor, [result.observation for _, result in answered],
                                      end_text=end_text)
        for (trajectory, result), (ids, images) in zip(answered, encoded):
            trajectory.transcript += [{"role": str(m["role"]), "content": _transcript_content(m["content"])}
                                      for m in result.observation]
            if len(trajectory.tokens) + len(ids) >= self.max_total_tokens:
                trajectory.done = True  # the answer does not fit with room for a model token
                continue
            trajectory.add(ids, None, trained=False)
            trajectory.images += images
            trajectory.answer_images += observation_images(result.observation) if images else []
            trajectory.pending += ids
            trajectory.pending_images += images

    @torch.no_grad()
    def _next_turn(self, trajectories: list[_Trajectory], active: list[int], prompts: Mapping[str, Any], *,
                   temperature: float, top_p: float, do_sample: bool, prompt_rows: Sequence[int] | None = None,
                   recorder: "_SampledLogProbRecorder | None" = None) -> list[list[int]]:
        """One model turn for each trajectory in ``active`` (its context: its prompt, ``prompts`` row
        ``prompt_rows[i]`` (default ``i``), and its tokens so far); returns the tokens each drew. ``recorder``: the
        log-prob recorder (a subclass may record more, e.g. ARPO's entropy probe)."""
        engine = self.engine
        prompt_rows = list(range(len(trajectories))) if prompt_rows is None else prompt_rows
        model = engine.model
        width = max(len(trajectories[i].tokens) for i in active)
        so_far = torch.full((len(active), width), engine.pad_token_id, dtype=torch.long)
        so_far_mask = torch.zeros((len(active), width), dtype=torch.long)
        for row, i in enumerate(active):
            tokens = trajectories[i].tokens
            so_far[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            so_far_mask[row, :len(tokens)] = 1
        contexts = extend_prompts(select_rows(prompts, [prompt_rows[i] for i in active]), so_far, so_far_mask,
                                  pad_token_id=engine.pad_token_id)
        contexts = _with_tool_images(contexts, [trajectories[i].images for i in active], engine.processor)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in model_inputs(contexts).items()}
        self.last_prefill_tokens += int(inputs["attention_mask"].sum())
        budgets = [self.max_total_tokens - len(trajectories[i].tokens) for i in active]
        max_new = min(self.max_tokens_per_turn, max(budgets))
        recorder = _SampledLogProbRecorder() if recorder is None else recorder
        warpers = [TemperatureLogitsWarper(temperature)] if do_sample and temperature != 1.0 else []
        warpers += [TopPLogitsWarper(top_p)] if do_sample and top_p < 1.0 else []
        sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None)
        was_training = model.training
        model.eval()
        try:
            with full_weights(model):
                output = model.generate(
                    **inputs, max_new_tokens=max_new, eos_token_id=engine.eos_token_id,
                    pad_token_id=engine.pad_token_id, use_cache=True, suppress_tokens=engine.suppressed_token_ids(),
                    logits_processor=LogitsProcessorList([*warpers, recorder]), **sampling)
        finally:
            model.train(was_training)
        new_ids = output[:, inputs["input_ids"].shape[1]:].cpu()
        log_probs = recorder.finish(output)
        mask = completion_mask_from_ids(new_ids, eos_token_id=engine.eos_token_id, forbidden_ids=engine.forbidden_ids)
        drawn = []
        for row, i in enumerate(active):
            keep = int(mask[row].sum())
            keep = min(keep, budgets[row])  # a truncated prefix of a sample is a sample of that prefix
            drawn.append(new_ids[row, :keep].tolist())
            self._add_turn(trajectories[i], drawn[-1], log_probs[row, :keep].tolist())
        return drawn

    def _next_turn_on_cache(self, kept: "_KeptCache", trajectories: list[_Trajectory], active: list[int],
                            prompts: Mapping[str, Any], *, temperature: float, top_p: float) -> None:
        """One sampled model turn for ``active`` on the kept KV cache: each trajectory's new tokens (its last turn's
        final token and the environment's answer, images included) are prefilled onto its cache row, then the
        engine's lean loop decodes from there; nothing of the conversation before is run again."""
        engine = self.engine
        model = engine.model
        kept.keep(active)
        last = [trajectories[i].pending[-1] for i in active]
        positions, deltas = kept.positions(model, engine.processor, prompts, trajectories, active)
        with torch.no_grad(), torch.inference_mode(), full_weights(model):
            self.last_prefill_tokens += kept.prefill(model, engine.processor, trajectories, active, positions,
                                                     pad_token_id=engine.pad_token_id)
        device = kept.valid.device
        rows = len(active)
        input_ids = torch.full((rows, kept.cache.length + 1), engine.pad_token_id, dtype=torch.long, device=device)
        input_ids[:, -1] = torch.tensor(last, dtype=torch.long, device=device)
        attention = torch.cat([kept.valid, torch.ones(rows, 1, dtype=kept.valid.dtype, device=device)], 1)
        budgets = [self.max_total_tokens - len(trajectories[i].tokens) for i in active]
        max_new = min(self.max_tokens_per_turn, max(budgets))
        backbone = model.model
        if deltas is not None:
            backbone.rope_deltas = deltas.to(device)
        was_training = model.training
        model.eval()
        try:
            with full_weights(model):
                sequences, log_probs = engine._lean_decode(
                    {"input_ids": input_ids, "attention_mask": attention, "cache": kept.cache}, cache_copies=1,
                    max_new_tokens=max_new, temperature=temperature, top_p=top_p, logits_processors=(),
                    return_log_probs=True)
        finally:
            model.train(was_training)
            engine._last_lean_cache = None  # the kept cache is ours; the engine holds no reference to it
        new_ids = sequences[:, input_ids.shape[1]:].cpu()
        mask = completion_mask_from_ids(new_ids, eos_token_id=engine.eos_token_id, forbidden_ids=engine.forbidden_ids)
        drawn = []
        for row, i in enumerate(active):
            keep = min(int(mask[row].sum()), budgets[row])
            drawn.append(new_ids[row, :keep].tolist())
            self._add_turn(trajectories[i], drawn[-1], log_probs[row, :keep].tolist())
        kept.after_turn(trajectories, active, drawn, steps=new_ids.shape[1])


    # ------------------------------------------------------------------ the vLLM engine

    def _generate_vllm(self, prompt_rows: list[dict[str, Any]], first_messages: list[str],
                       envs: Sequence[Environment], *, num_samples: int, temperature: float, top_p: float,
                       do_sample: bool) -> Rollout:
        """The rollout on :class:`~mmpo.vlm.vllm_engine.VLLMEngine`: every turn of the running trajectories is one
        vLLM call (:meth:`_vllm_turn`)."""
        prompts, starts, prompt_images = self.vllm_prompts(prompt_rows)
        owners = [i // num_samples for i in range(len(envs))]
        trajectories = [_Trajectory() for _ in envs]
        for trajectory, message in zip(trajectories, first_messages):
            trajectory.transcript.append({"role": "user", "content": message})
        active = list(range(len(trajectories)))
        while active:
            self._vllm_turn(trajectories, active, [starts[owners[i]] for i in active],
                            None if prompt_images is None else [prompt_images[owners[i]] for i in active],
                            temperature=temperature, top_p=top_p, do_sample=do_sample)
            self._step_environments(trajectories, envs)  # a text LM refuses image answers (encode_observation)
            active = [i for i in active if not trajectories[i].done]
        self.last_transcripts = [t.transcript for t in trajectories]
        group_ids = torch.arange(len(prompt_rows)).repeat_interleave(num_samples)
        return self._rollout([prompt_rows[i] for i in group_ids.tolist()], group_ids, repeat_rows(prompts, num_samples),
                             trajectories)

    def vllm_prompts(self, prompt_rows: Sequence[Mapping[str, Any]]
                     ) -> tuple[Mapping[str, Any], list[list[int]], list[list[Any]] | None]:
        """The trainer's prompt batch of ``prompt_rows`` (:func:`encode_prompts`), each prompt's token ids, and (a VLM)
        each prompt's images as the vLLM engine takes them (None for a text LM)."""
        engine = self.engine
        prompts = encode_prompts(engine.processor, prompt_rows, system_prompt=engine.system_prompt,
                                 max_prompt_length=engine.max_prompt_length)
        starts = [ids[mask > 0].tolist() for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
        return prompts, starts, None if engine.text_only else engine.prompt_images(prompt_rows)

    def _vllm_turn(self, trajectories: list[_Trajectory], active: list[int], starts: Sequence[Sequence[int]],
                   prompt_images: Sequence[Sequence[Any]] | None, *, temperature: float, top_p: float,
                   do_sample: bool, top_logprobs: int = 0) -> list[Any]:
        """One model turn of each trajectory in ``active`` on the vLLM engine (its prompt ``starts[k]``, a VLM's prompt
        images ``prompt_images[k]``), as one vLLM call: each trajectory is a request whose prompt is its prompt and
        conversation so far as token ids (vLLM's prefix cache holds the earlier turns' KV; within the call vLLM
        batches the requests continuously), a VLM's with its images, the prompt's then the environment answers'
        (resized as :func:`encode_observation` resized them), in the order of their placeholders. Each request ends
        at its turn-end token or its budget (``min(max_tokens_per_turn, max_total_tokens - tokens so far)``). Returns
        the engine's :class:`~mmpo.vlm.vllm_engine.TurnSample` per trajectory (``top_logprobs``: its top log-probs)."""
        engine = self.engine
        budgets = [min(self.max_tokens_per_turn, self.max_total_tokens - len(trajectories[i].tokens)) for i in active]
        images = None if prompt_images is None else [
            [*prompt_images[k], *resized_images(engine.processor, trajectories[i].answer_images)]
            for k, i in enumerate(active)]
        samples = engine.continue_token_ids([[*starts[k], *trajectories[i].tokens] for k, i in enumerate(active)],
                                            budgets, images=images, temperature=temperature, top_p=top_p,
                                            do_sample=do_sample, top_logprobs=top_logprobs)
        for k, (i, sample) in enumerate(zip(active, samples)):
            if trajectories[i].turns:  # a later turn: the context vLLM did not serve from its prefix cache
                self.last_prefill_tokens += len(starts[k]) + len(trajectories[i].tokens) - sample.cached_tokens
            self._add_turn(trajectories[i], sample.tokens, sample.log_probs)
        return samples

    # ------------------------------------------------------------------ continuous batching

    def _generate_continuous(self, prompt_rows: list[dict[str, Any]], first_messages: list[str],
                             envs: Sequence[Environment], *, num_samples: int, temperature: float, top_p: float,
                             do_sample: bool) -> Rollout | None:
        """The whole rollout with continuous batching across turns (the module docstring), or None (nothing drawn,
        ``last_schedule`` says why) where the engine's lean loop does not cover the model."""
        engine = self.engine
        model = engine.model
        if not engine.lean_decode:
            self.last_schedule = "turns: lean_decode=False"
            return None
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        prompts = encode_prompts(engine.processor, prompt_rows, system_prompt=engine.system_prompt,
                                 max_prompt_length=engine.max_prompt_length)
        if prompts["input_ids"].shape[1] < 2:
            self.last_schedule = "turns: a one-token prompt"
            return None
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in model_inputs(prompts).items()}
        special = dict(eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id, use_cache=True)
        trajectories = [_Trajectory() for _ in envs]
        for trajectory, message in zip(trajectories, first_messages):
            trajectory.transcript.append({"role": "user", "content": message})
        repeated = repeat_rows(prompts, num_samples)
        was_training = model.training
        model.eval()
        try:
            with full_weights(model), torch.no_grad():
                # each prompt but its last token once through the model (images encoded once), as the engine does
                prefilled = engine._prefill(inputs, num_samples, special, expand_cache=False)
                blocker = lean_decode_blocker(model, prefilled, do_sample=True, max_new_tokens=1)
                if blocker is not None:
                    self.last_schedule = f"turns: {blocker}"
                    return None
                self.last_schedule = "continuous"
                self._decode_continuous(prefilled, repeated, trajectories, envs, copies=num_samples,
                                        temperature=temperature, top_p=top_p, do_sample=do_sample)
        finally:
            model.train(was_training)
        self.last_transcripts = [t.transcript for t in trajectories]
        group_ids = torch.arange(len(prompt_rows)).repeat_interleave(num_samples)
        return self._rollout([prompt_rows[i] for i in group_ids.tolist()], group_ids, repeated, trajectories)

    def _decode_continuous(self, prefilled: Mapping[str, Any], prompts: Mapping[str, Any],
                           trajectories: list[_Trajectory], envs: Sequence[Environment], *, copies: int,
                           temperature: float, top_p: float, do_sample: bool) -> None:
        """Decode every trajectory to its end, one token per running trajectory per step (see the module docstring).

        ``prefilled``: :meth:`HFGenerateEngine._prefill`'s output (a cache of each prompt but its last token, one row
        per prompt, ``copies`` trajectories per prompt; Qwen-VL's ``rope_deltas`` per trajectory). A step first runs
        the trajectories starting a turn (their last turn's final token and the environment's answer, images
        included, right-padded to the longest) through one forward over just their cache rows, then feeds every
        running trajectory one token (its last sampled one, or its new turn's header's last token); each row's keys
        go to its own next cache positions (:class:`_RowCache`), and the next token is drawn as HF ``_sample`` draws:
        vision tokens suppressed (and the turn end before the generation config's ``min_new_tokens`` in a turn), then
        temperature and top-p, then ``multinomial`` (argmax when greedy), the log-prob taken from the distribution
        drawn from."""
        engine = self.engine
        model = engine.model
        text = getattr(model.model, "language_model", model.model)
        multimodal = text is not model.model
        backbone = model.model
        device = prefilled["input_ids"].device
        eos, pad = engine.eos_token_id, engine.pad_token_id
        forbidden = set(engine.forbidden_ids)
        attention = prefilled["attention_mask"]
        banned = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool, device=device)
        banned[engine.suppressed_token_ids() or []] = True
        min_new_tokens = model.generation_config.min_new_tokens or 0
        warpers = [TemperatureLogitsWarper(temperature)] if do_sample and temperature != 1.0 else []
        warpers += [TopPLogitsWarper(top_p)] if do_sample and top_p < 1.0 else []
        # each layer's forward: HF's own ops called directly where that is the same computation (decode_layer_step,
        # as the engine's lean loop does; for an answer's chunk too), else the layer's HF call
        direct = [direct_decode_layer(layer) for layer in text.layers]

        def run_layers(hidden: torch.Tensor, mask: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            for layer, step in zip(text.layers, direct):
                if step:
                    hidden = decode_layer_step(layer, hidden, mask, rope, cache)
                else:
                    hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None,
                                   cache=cache, use_cache=True)
            return hidden

        first_limit = min(self.max_tokens_per_turn, self.max_total_tokens)
        with torch.inference_mode():
            cache = _RowCache(prefilled["cache"], attention[:, :-1].bool(), copies=copies,
                              extra=first_limit + 1)
        # per running row: its trajectory, the tokens it feeds next (and their images), its real tokens in the cache,
        # its RoPE offset (Qwen-VL), the current turn's tokens and log-probs, and the turn's token limit
        rows = list(range(len(trajectories)))
        feed = [[int(token)] for token in prefilled["input_ids"][:, -1].tolist()]
        feed_images: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
        counts = [int(c) for c in attention[:, :-1].sum(-1).tolist()]
        deltas = [int(d) for d in backbone.rope_deltas.reshape(-1).tolist()] if multimodal else [0] * len(rows)
        turn_ids: list[list[int]] = [[] for _ in rows]
        turn_log_probs: list[list[float]] = [[] for _ in rows]
        limits = [first_limit] * len(rows)
        # the previous step fed every row its sampled token and no row started or ended a turn: this step's ids are the
        # tokens just drawn and its positions the last ones + 1 (no new tensors from the Python lists)
        plain = False
        while rows:
            # trajectories starting a turn: the environment's answer (all but the new turn's header's last token) onto
            # their own cache rows first, in one forward over just those rows, so the step below stays one token wide
            starting = [row for row, tokens in enumerate(feed) if len(tokens) > 1]
            if starting:
                chunks = [feed[row][:-1] for row in starting]
                width = max(len(chunk) for chunk in chunks)
                ids = torch.tensor([chunk + [pad] * (width - len(chunk)) for chunk in chunks], dtype=torch.long)
                places = torch.tensor([[counts[row] + deltas[row] + k for k in range(width)] for row in starting],
                                      dtype=torch.long)
                if multimodal:
                    places = places.unsqueeze(0).repeat(3, 1, 1)
                    for index, row in enumerate(starting):
                        if feed_images[row]:
                            i = rows[row]
                            position, delta = _multimodal_positions(backbone, engine.processor, prompts, i,
                                                                    trajectories[i], len(feed[row]))
                            places[:, index, :len(chunks[index])] = position[:, :-1]
                            deltas[row] = int(delta.reshape(-1)[0])
                # every running row starting a turn (turns of equal length): the forward over all rows, in place,
                # not over a gathered copy of their cache rows
                subset = None if len(starting) == len(rows) else starting
                with torch.inference_mode():
                    ids = ids.to(device)
                    hidden = _embed_chunk(model, ids, [image for row in starting for image in feed_images[row]])
                    rope = text.rotary_emb(hidden, places.to(device))
                    run_layers(hidden, cache.begin(width, subset), rope)
                    cache.advance([len(chunk) for chunk in chunks], subset)
                for row, chunk in zip(starting, chunks):
                    counts[row] += len(chunk)
                    feed[row], feed_images[row] = feed[row][-1:], []
                self.last_prefill_tokens += sum(len(chunk) for chunk in chunks)
            # one token per running trajectory
            if plain and not starting:
                ids, places = tokens[:, None], places + 1
            else:
                ids = torch.tensor(feed, dtype=torch.long)
                places = torch.tensor([[c + d] for c, d in zip(counts, deltas)], dtype=torch.long)
                if multimodal:
                    places = places.unsqueeze(0).expand(3, -1, -1)
            early = [len(turn) < min_new_tokens for turn in turn_ids] if min_new_tokens else []
            with torch.inference_mode():
                ids = ids.to(device)
                hidden = text.embed_tokens(ids)
                rope = text.rotary_emb(hidden, places.to(device))
                hidden = run_layers(hidden, cache.begin(1), rope)
                scores = model.lm_head(text.norm(hidden)[:, -1]).float()  # a fresh tensor: filled in place
                cache.advance([1] * len(rows))
                scores.masked_fill_(banned, -math.inf)
                if all(early) and early:  # the turn end too, in the rows still short of min_new_tokens in their turn
                    scores[:, eos] = -math.inf
                elif any(early):
                    scores[:, eos].masked_fill_(torch.tensor(early, device=device), -math.inf)
                for warper in warpers:
                    scores = warper(ids, scores)
                if do_sample:
                    tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    tokens = torch.argmax(scores, dim=-1)
                log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
            ended = []
            for row, (token, log_prob) in enumerate(zip(tokens.tolist(), log_probs.tolist())):
                counts[row] += 1
                if token not in forbidden:  # never drawn while suppressed; should one be, it cuts the turn
                    turn_ids[row].append(token)
                    turn_log_probs[row].append(log_prob)
                if token in forbidden or token == eos or len(turn_ids[row]) >= limits[row]:
                    ended.append(row)
                else:
                    feed[row] = [token]
            plain = not ended
            if not ended:
                continue
            # the turns that ended at this step, their texts decoded in one call
            decoded = engine.processor.batch_decode([turn_ids[row] for row in ended], skip_special_tokens=True)
            for row, message in zip(ended, decoded):
                trajectory = trajectories[rows[row]]
                self._add_turn(trajectory, turn_ids[row], turn_log_probs[row], message)
                trajectory.pending = turn_ids[row][-1:]
            self._step_environments(trajectories, envs)
            keep = []
            for row in range(len(rows)):
                trajectory = trajectories[rows[row]]
                if row in ended:
                    if trajectory.done:
                        continue
                    feed[row], feed_images[row] = trajectory.pending, trajectory.pending_images
                    trajectory.pending, trajectory.pending_images = [], []
                    turn_ids[row], turn_log_probs[row] = [], []
                    limits[row] = min(self.max_tokens_per_turn, self.max_total_tokens - len(trajectory.tokens))
                keep.append(row)
            if len(keep) < len(rows):
                with torch.inference_mode():
                    cache.select(keep)
                rows, feed, feed_images, counts, deltas, turn_ids, turn_log_probs, limits = (
                    [values[row] for row in keep] for values in (rows, feed, feed_images, counts, deltas, turn_ids,
                                                                 turn_log_probs, limits))

    # ------------------------------------------------------------------ result

    def _rollout(self, rows: list[Mapping[str, Any]], group_ids: torch.Tensor, prompts: Mapping[str, Any],
                 trajectories: list[_Trajectory]) -> Rollout:
        """Trajectory ``i`` answers ``rows[i]`` (group ``group_ids[i]``, prompt ``prompts`` row ``i``)."""
        width = max(1, max(len(t.tokens) for t in trajectories))
        n = len(trajectories)
        ids = torch.full((n, width), self.engine.pad_token_id, dtype=torch.long)
        trained = torch.zeros((n, width), dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        log_probs = torch.zeros((n, width), dtype=torch.float32)
        for i, t in enumerate(trajectories):
            length = len(t.tokens)
            ids[i, :length] = torch.tensor(t.tokens, dtype=torch.long)
            trained[i, :length] = torch.tensor(t.trained, dtype=torch.long)
            attention[i, :length] = 1
            log_probs[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32) * trained[i, :length]
        extras = {
            "completion_attention_mask": attention, "engine_log_probs": log_probs,
            "turns": torch.tensor([t.turns for t in trajectories], dtype=torch.long),
            "tool_calls": torch.tensor([t.tool_calls for t in trajectories], dtype=torch.long),
            "env_rewards": torch.tensor([t.env_reward for t in trajectories], dtype=torch.float32),
            "vision_cut": torch.zeros(n, dtype=torch.bool),
        }
        prompt_inputs = append_row_images(prompts, [t.images for t in trajectories])
        return Rollout(rows=list(rows), group_ids=group_ids, prompt_inputs=prompt_inputs,
                       completion_ids=ids, completion_mask=trained, texts=[t.last_message for t in trajectories],
                       extras=extras)


def _with_tool_images(contexts: Mapping[str, Any], images: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                      processor: Any) -> Mapping[str, Any]:
    """Generation contexts (prompt + conversation so far as one prompt) with the tool answers' images after the
    prompt's, and their placeholders typed as images (``mm_token_type_ids`` 1) for Qwen-VL's 3-D RoPE."""
    if not any(images):
        return contexts
    from mmpo.vlm.processing import image_token_types

    out = append_row_images(contexts, images)
    out["mm_token_type_ids"] = image_token_types(out["input_ids"], processor).to(out["mm_token_type_ids"])
    return out


def _multimodal_positions(backbone: Any, processor: Any, prompts: Mapping[str, Any], prompt_row: int,
                          trajectory: _Trajectory, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-VL's 3-D RoPE positions (3, ``count``) of the last ``count`` tokens of ``trajectory`` (prompt row
    ``prompt_row`` of ``prompts``, then its tokens; images included), and the RoPE offset of what follows them:
    ``get_rope_index`` over the row's real sequence, as the training forward computes them."""
    from mmpo.vlm.processing import image_token_types, row_image_counts

    ids, attention = prompts["input_ids"], prompts["attention_mask"]
    grid = prompts.get("image_grid_thw")
    counts = row_image_counts(prompts).tolist() if grid is not None and len(grid) else [0] * ids.shape[0]
    first = sum(counts[:prompt_row])
    sequence = torch.cat([ids[prompt_row][attention[prompt_row] > 0].cpu(),
                          torch.tensor(trajectory.tokens, dtype=torch.long)])
    grids = [grid[j].cpu() for j in range(first, first + counts[prompt_row])] if counts[prompt_row] else []
    grids += [thw.reshape(3).cpu() for _, thw in trajectory.images]
    types = image_token_types(sequence[None], processor)
    position, delta = backbone.get_rope_index(sequence[None], mm_token_type_ids=types,
                                              image_grid_thw=torch.stack(grids) if grids else None)
    return position[:, 0, len(sequence) - count:], delta


def _embed_chunk(model: Any, ids: torch.Tensor, images: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The text decoder's input embeddings of ``ids`` (rows, width), each image placeholder replaced by its image's
    features (``images`` in the order of the placeholders, row by row)."""
    text = getattr(model.model, "language_model", model.model)
    hidden = text.embed_tokens(ids)
    if images:
        pixels = torch.cat([p for p, _ in images]).to(ids.device, model.model.visual.dtype)
        grids = torch.stack([thw.reshape(3) for _, thw in images]).to(ids.device)
        features = torch.cat(model.model.get_image_features(pixels, grids, return_dict=True).pooler_output)
        placeholders = (ids == int(model.config.image_token_id)).unsqueeze(-1).expand_as(hidden)
        hidden = hidden.masked_scatter(placeholders, features.to(hidden.dtype))
    return hidden


class _KeptCache:
    """The KV cache of the running trajectories across turns, one row each, in the engine's lean-loop buffers.

    The rows share one length; ``valid`` (rows, length) says which positions each row attends to: a row's prompt
    (left padding hidden), its tokens, and holes where other rows ran longer (the steps after a row's turn ended, the
    left padding of a shorter new-token chunk). Positions are a row's count of real tokens before a token (text LMs)
    or Qwen-VL's 3-D RoPE positions of its real sequence (``get_rope_index`` over prompt + conversation), so a
    token gets exactly the position and context the training forward over the compact sequence gives it."""

    def __init__(self, cache: Any, valid: torch.Tensor, rows: list[int]) -> None:
        self.cache = cache
        self.valid = valid
        self.rows = rows  # trajectory index of each cache row

    @classmethod
    def after_first_turn(cls, cache: Any, prompt_attention: torch.Tensor, trajectories: list[_Trajectory], *,
                         steps: int) -> "_KeptCache":
        """The lean loop ran ``steps`` steps: the cache holds each prompt and the first ``steps - 1`` sampled tokens
        (a row's positions after its own last token are holes)."""
        device = cache.keys[0].device
        decoded = torch.zeros(len(trajectories), max(steps - 1, 0), dtype=torch.long)
        for row, trajectory in enumerate(trajectories):
            fed = min(len(trajectory.tokens), steps - 1)
            decoded[row, :fed] = 1
            trajectory.pending = trajectory.tokens[fed:]
        valid = torch.cat([prompt_attention.long().cpu(), decoded], 1).to(device)
        if valid.shape[1] != cache.length:
            raise RuntimeError(f"kept cache holds {cache.length} positions, expected {valid.shape[1]}")
        return cls(cache, valid, list(range(len(trajectories))))

    def keep(self, active: list[int]) -> None:
        """Drop the rows of finished trajectories (rows follow ``active``'s order)."""
        if active == self.rows:
            return
        position = {trajectory: row for row, trajectory in enumerate(self.rows)}
        index = [position[i] for i in active]
        self.cache.select(index)
        self.valid = self.valid[torch.tensor(index, device=self.valid.device)]
        self.rows = list(active)

    def positions(self, model: Any, processor: Any, prompts: Mapping[str, Any], trajectories: list[_Trajectory],
                  active: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per active trajectory, the positions of its pending tokens ((len,) text LM; (3, len) Qwen-VL), and the
        Qwen-VL RoPE offsets (rows, 1) of what follows them (None for a text LM)."""
        backbone = model.model
        if not hasattr(backbone, "get_rope_index"):
            counts = self.valid.sum(-1).tolist()
            return [torch.arange(int(c), int(c) + len(trajectories[i].pending)) for c, i in zip(counts, active)], None
        out, deltas = [], []
        for i in active:
            position, delta = _multimodal_positions(backbone, processor, prompts, i, trajectories[i],
                                                    len(trajectories[i].pending))
            out.append(position)
            deltas.append(delta.reshape(1))
        return out, torch.stack(deltas)

    def prefill(self, model: Any, processor: Any, trajectories: list[_Trajectory], active: list[int],
                positions: list[torch.Tensor], *, pad_token_id: int) -> int:
        """Run each active trajectory's pending tokens but the last through the text decoder onto the cache (left
        padded to a common width; the pad positions become holes); returns the real tokens run."""
        chunks = [trajectories[i].pending[:-1] for i in active]
        width = max(len(chunk) for chunk in chunks)
        device = self.valid.device
        rows = len(active)
        chunk_valid = torch.zeros(rows, width, dtype=self.valid.dtype, device=device)
        if width:
            ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
            multimodal = positions[0].ndim == 2
            place = torch.zeros((3, rows, width) if multimodal else (rows, width), dtype=torch.long, device=device)
            for row, chunk in enumerate(chunks):
                if chunk:
                    ids[row, width - len(chunk):] = torch.tensor(chunk, dtype=torch.long)
                    chunk_valid[row, width - len(chunk):] = 1
                    place[..., row, width - len(chunk):] = positions[row][..., :len(chunk)].to(device)
            text = getattr(model.model, "language_model", model.model)
            hidden = _embed_chunk(model, ids, [image for i in active for image in trajectories[i].pending_images])
            rope = text.rotary_emb(hidden, place)
            self.cache.reserve(width)
            seen = torch.cat([self.valid, chunk_valid], 1).bool()
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            mask = seen[:, None, None, :].repeat(1, 1, width, 1)
            mask[..., self.valid.shape[1]:] &= causal
            mask |= torch.eye(self.valid.shape[1] + width, dtype=torch.bool, device=device)[-width:]  # a hole sees itself
            for layer in text.layers:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None,
                               cache=self.cache, use_cache=True)
        self.valid = torch.cat([self.valid, chunk_valid], 1)
        for i in active:
            trajectories[i].pending_images = []
        return int(chunk_valid.sum())

    def after_turn(self, trajectories: list[_Trajectory], active: list[int], drawn: list[list[int]], *,
                   steps: int) -> None:
        """The lean loop fed each row's last pending token, then ran ``steps`` steps (feeding ``steps - 1`` sampled
        tokens, holes after a row's own end); the tokens it did not feed become the row's pending tokens."""
        device = self.valid.device
        decoded = torch.zeros(len(active), 1 + max(steps - 1, 0), dtype=self.valid.dtype, device=device)
        decoded[:, 0] = 1
        for row, (i, tokens) in enumerate(zip(active, drawn)):
            fed = min(len(tokens), steps - 1)
            decoded[row, 1:1 + fed] = 1
            trajectories[i].pending = tokens[fed:]
        self.valid = torch.cat([self.valid, decoded], 1)
        if self.valid.shape[1] != self.cache.length:
            raise RuntimeError(f"kept cache holds {self.cache.length} positions, expected {self.valid.shape[1]}")


class _RowCache:
    """The KV cache of continuously batched trajectories: one row each, every row appended to at its own length.

    A step's chunk (rows, width) is right-padded: row ``r``'s real tokens are its first ``w_r`` columns, written to its
    positions ``lengths[r] .. lengths[r] + w_r - 1``; the pad columns land after them, are never attended by a real
    token, and are overwritten by the row's next step. ``valid`` (rows, capacity) marks each row's real positions (its
    prompt without the left padding, then every token it fed), so a row's cache has no holes past its prompt however
    the rows' turns interleave. Only ``update`` is used by the decoder layers (as :class:`_GrowingKVCache`).

    While every row has the same length (``uniform``: the prompts' padded width plus the same tokens fed, e.g. turns and
    answers of equal lengths), a decode step writes one column slice instead of one indexed position per row (the same
    positions and values, tests/agents/test_continuous_fast_paths.py)."""

    def __init__(self, cache: Any, prompt_valid: torch.Tensor, *, copies: int, extra: int) -> None:
        """``cache``: each prompt but its last token, one row per prompt, each to become ``copies`` rows;
        ``prompt_valid`` (rows, length): the real positions of every row (the prompts' attention masks, repeated)."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        length = prompt_valid.shape[1]
        for layer in cache.layers:
            for source, buffers in ((layer.keys, self.keys), (layer.values, self.values)):
                rows, heads, _, dim = source.shape
                # zeros, never garbage: a masked position's value still enters attention's weighted sum (times 0)
                buffer = source.new_zeros((rows * copies, heads, length + extra, dim))
                buffer[:, :, :length].unflatten(0, (rows, copies)).copy_(source[:, :, :length].unsqueeze(1))
                buffers.append(buffer)
        device = self.keys[0].device
        self.valid = torch.zeros(prompt_valid.shape[0], length + extra, dtype=torch.bool, device=device)
        self.valid[:, :length] = prompt_valid
        self.lengths = torch.full((self.valid.shape[0],), length, dtype=torch.long, device=device)
        self.end = length  # the longest row's length
        self.uniform = True  # every row has the same length (``end``): a decode step writes one column slice
        self._write: torch.Tensor | None = None
        self._column: int | None = None  # the column a uniform decode step writes
        self._subset: torch.Tensor | None = None

    def begin(self, width: int, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Room for a chunk of ``width`` columns of ``rows`` (default: all, in order; else a forward over just those
        rows); returns its attention mask (rows, 1, width, keys): a real column of row ``r`` sees the row's real
        positions and its own chunk up to itself."""
        need = self.end + width
        if self.valid.shape[1] < need:
            grow = max(need, 2 * self.valid.shape[1])
            for buffers in (self.keys, self.values):
                for index, buffer in enumerate(buffers):
                    grown = buffer.new_zeros((*buffer.shape[:2], grow, buffer.shape[3]))
                    grown[:, :, :self.end] = buffer[:, :, :self.end]
                    buffers[index] = grown
            valid = self.valid.new_zeros((self.valid.shape[0], grow))
            valid[:, :self.end] = self.valid[:, :self.end]
            self.valid = valid
        device = self.valid.device
        if width == 1 and rows is None and self.uniform:  # a decode step, every row at ``end``: one column
            self._subset, self._column, self._stop = None, self.end, need
            self.valid[:, self.end] = True
            return self.valid[:, None, None, :need]
        self._column = None
        columns = torch.arange(width, device=device)
        if rows is None:
            self._subset = None
            index = torch.arange(self.valid.shape[0], device=device)
            lengths, valid = self.lengths, self.valid
        else:
            index = self._subset = torch.as_tensor(list(rows), dtype=torch.long, device=device)
            lengths, valid = self.lengths[index], self.valid[index]
            need = int(lengths.max()) + width
        self._write = lengths[:, None] + columns  # (rows, width)
        self._rows = index[:, None]
        self._stop = need
        if width == 1 and rows is None:  # a decode step: each row's new position is real; it sees those
            self.valid[self._rows, self._write] = True
            return self.valid[:, None, None, :need]
        relative = torch.arange(need, device=device)[None, :] - lengths[:, None]  # (rows, keys)
        own = (relative[:, None, :] >= 0) & (relative[:, None, :] <= columns[None, :, None])
        return (valid[:, None, :need] | own).unsqueeze(1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self._column is not None:  # the same positions as the indexed write below, as a slice
            self.keys[layer_idx][:, :, self._column:self._column + 1] = key_states
            self.values[layer_idx][:, :, self._column:self._column + 1] = value_states
            return self.keys[layer_idx][:, :, :self._stop], self.values[layer_idx][:, :, :self._stop]
        self.keys[layer_idx][self._rows, :, self._write] = key_states.transpose(1, 2)
        self.values[layer_idx][self._rows, :, self._write] = value_states.transpose(1, 2)
        keys, values = self.keys[layer_idx][:, :, :self._stop], self.values[layer_idx][:, :, :self._stop]
        if self._subset is not None:
            keys, values = keys.index_select(0, self._subset), values.index_select(0, self._subset)
        return keys, values

    def advance(self, widths: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """The chunk's real columns (``widths[k]`` of its ``k``-th row) are in the cache now."""
        if self._column is not None or (self._write.shape[1] == 1 and rows is None):
            # a decode step (``begin`` marked its positions); every row one longer: as uniform as before
            self.lengths = self.lengths + 1
            self.end += 1
            return
        columns = torch.arange(self._write.shape[1], device=self.valid.device)
        widths = torch.tensor(widths, device=self.valid.device)
        self.valid[self._rows, self._write] |= columns[None, :] < widths[:, None]
        if rows is None:
            self.lengths = self.lengths + widths
        else:
            self.lengths = self.lengths.index_add(0, self._rows[:, 0], widths)
        self.end = int(self.lengths.max())
        self.uniform = int(self.lengths.min()) == self.end

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), e.g. the trajectories still running."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        self.keys = [buffer.index_select(0, index) for buffer in self.keys]
        self.values = [buffer.index_select(0, index) for buffer in self.values]
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.end = int(self.lengths.max()) if len(index) else 0
        self.uniform = not len(index) or int(self.lengths.min()) == self.end
