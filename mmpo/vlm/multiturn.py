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

Decoding: the first turn goes through the engine's own :meth:`~mmpo.vlm.rollout.HFGenerateEngine.generate`
(each prompt prefilled once for its G samples, the lean decoding loop where it applies). Each later turn
re-prefills the whole conversation so far (``model.generate`` on the left-padded contexts, images of the
prompt included): the KV cache of the earlier turns is not kept across the environment's answer. That is
correct by construction (the same positions and masks as the training forward) at the price of one prefill of
the context per turn; keeping the cache needs per-row insertion of the environment tokens into a batched
cache, left for later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from mmpo.tools.env import Environment, ToolEnvironment
from mmpo.tools.functions import tool_system_prompt
from mmpo.vlm.continuation import extend_prompts
from mmpo.vlm.fsdp import full_weights
from mmpo.vlm.processing import default_system_prompt, model_inputs, select_rows
from mmpo.vlm.rollout import (HFGenerateEngine, Rollout, _SampledLogProbRecorder, completion_attention_mask,  # noqa: F401
                              completion_mask_from_ids)

_TURN_SENTINEL = "\u2063MMPO_TURN\u2063"


def observation_token_ids(processor: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens that follow a model turn's end token when the chat template renders ``messages`` (the
    environment's answer) after it, through the next assistant header.

    Found by rendering a conversation whose assistant message is a sentinel, with and without ``messages``
    and the generation prompt, and taking the text after the sentinel's turn end: whatever the template writes
    between turns (newlines, ``<|im_start|>tool`` / ``user``, ``<tool_response>`` wrappers) is kept exactly."""
    tokenizer = processor.tokenizer
    end_text = tokenizer.convert_ids_to_tokens(_turn_end_id(processor))
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _TURN_SENTINEL}]
    text = processor.apply_chat_template([*base, *[dict(m) for m in messages]], tokenize=False,
                                         add_generation_prompt=True)
    anchor = text.find(_TURN_SENTINEL + end_text)
    if anchor < 0:
        raise ValueError(f"the chat template does not close an assistant message with {end_text!r}; "
                         "multi-turn rollouts need the turn-end token after each assistant message")
    suffix = text[anchor + len(_TURN_SENTINEL) + len(end_text):]
    return list(tokenizer(suffix, add_special_tokens=False)["input_ids"])


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
    """

    def __init__(self, engine: HFGenerateEngine, *, max_turns: int, max_total_tokens: int,
                 max_tokens_per_turn: int) -> None:
        if min(max_turns, max_total_tokens, max_tokens_per_turn) < 1:
            raise ValueError("max_turns, max_total_tokens and max_tokens_per_turn must be >= 1")
        self.engine = engine
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.last_transcripts: list[list[dict[str, str]]] = []
        """Each trajectory of the last :meth:`generate` as chat messages (for rollout logs)."""

    def generate(self, rows: Sequence[Mapping[str, Any]], envs: Sequence[Environment], *, num_samples: int,
                 temperature: float = 1.0, top_p: float = 1.0, do_sample: bool = True) -> Rollout:
        """``num_samples`` trajectories per row; ``envs`` holds one fresh environment per trajectory
        (``len(rows) * num_samples``, trajectory ``i`` answers row ``i // num_samples``)."""
        first, trajectories = self.start(rows, envs, num_samples=num_samples, temperature=temperature, top_p=top_p,
                                         do_sample=do_sample)
        prompts = first.prompt_inputs
        while True:
            self._step_environments(trajectories, envs)
            active = [i for i, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            self._next_turn(trajectories, active, prompts, temperature=temperature, top_p=top_p, do_sample=do_sample)
        self.last_transcripts = [t.transcript for t in trajectories]
        return self._rollout(first, trajectories)

    def start(self, rows: Sequence[Mapping[str, Any]], envs: Sequence[Environment], *, num_samples: int,
              temperature: float = 1.0, top_p: float = 1.0, do_sample: bool = True) -> tuple[Rollout, list[_Trajectory]]:
        """The first model turn of ``num_samples`` trajectories per row (environments reset, not yet stepped):
        the engine's first-turn rollout (its ``prompt_inputs`` are every later turn's prompts) and the
        trajectories. :meth:`generate` and tree rollouts (:mod:`mmpo.algos.dialtree`) continue from here."""
        rows = list(rows)
        if len(envs) != len(rows) * num_samples:
            raise ValueError(f"{len(envs)} environments for {len(rows)} rows x {num_samples} samples")
        engine = self.engine
        first_messages = [env.reset(rows[i // num_samples]) for i, env in enumerate(envs)]
        base_system = engine.system_prompt
        prompt_rows = []
        for index, row in enumerate(rows):
            system = row.get("system_prompt", base_system)
            system = default_system_prompt() if system == "default" else system
            prompt_rows.append({**row, "problem": first_messages[index * num_samples],
                                "system_prompt": tool_system_prompt(system, envs[index * num_samples].tools)})
        first = engine.generate(prompt_rows, num_samples=num_samples,
                                max_new_tokens=min(self.max_tokens_per_turn, self.max_total_tokens),
                                temperature=temperature, top_p=top_p, do_sample=do_sample, return_log_probs=True)
        trajectories = [_Trajectory() for _ in envs]
        for i, trajectory in enumerate(trajectories):
            trajectory.transcript.append({"role": "user", "content": first_messages[i]})
            keep = first.completion_mask[i] > 0
            self._add_turn(trajectory, first.completion_ids[i][keep].tolist(),
                           first.extras["engine_log_probs"][i][keep].tolist())
        return first, trajectories

    # ------------------------------------------------------------------ turns

    def _add_turn(self, trajectory: _Trajectory, tokens: list[int], log_probs: list[float]) -> None:
        trajectory.add(tokens, log_probs, trained=True)
        trajectory.turns += 1
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
        if all(isinstance(envs[i], ToolEnvironment) for i in waiting):
            results = ToolEnvironment.step_batch([envs[i] for i in waiting], messages)
        else:
            results = [envs[i].step(message) for i, message in zip(waiting, messages)]
        for i, result in zip(waiting, results):
            trajectory = trajectories[i]
            trajectory.awaiting_environment = False
            trajectory.env_reward += float(result.reward)
            trajectory.tool_calls += int(result.info.get("tool_calls", 0))
            if result.done or not result.observation or trajectory.turns >= self.max_turns:
                trajectory.done = True  # the environment is done, or no model turn would follow its answer
                continue
            ids = observation_token_ids(self.engine.processor, result.observation)
            trajectory.transcript += [{"role": str(m["role"]), "content": str(m["content"])}
                                      for m in result.observation]
            if len(trajectory.tokens) + len(ids) >= self.max_total_tokens:
                trajectory.done = True  # the answer does not fit with room for a model token
                continue
            trajectory.add(ids, None, trained=False)

    @torch.no_grad()
    def _next_turn(self, trajectories: list[_Trajectory], active: list[int], prompts: Mapping[str, Any], *,
                   temperature: float, top_p: float, do_sample: bool) -> None:
        engine = self.engine
        model = engine.model
        width = max(len(trajectories[i].tokens) for i in active)
        so_far = torch.full((len(active), width), engine.pad_token_id, dtype=torch.long)
        so_far_mask = torch.zeros((len(active), width), dtype=torch.long)
        for row, i in enumerate(active):
            tokens = trajectories[i].tokens
            so_far[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            so_far_mask[row, :len(tokens)] = 1
        contexts = extend_prompts(select_rows(prompts, active), so_far, so_far_mask, pad_token_id=engine.pad_token_id)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in model_inputs(contexts).items()}
        budgets = [self.max_total_tokens - len(trajectories[i].tokens) for i in active]
        max_new = min(self.max_tokens_per_turn, max(budgets))
        recorder = _SampledLogProbRecorder()
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
        for row, i in enumerate(active):
            keep = int(mask[row].sum())
            keep = min(keep, budgets[row])  # a truncated prefix of a sample is a sample of that prefix
            self._add_turn(trajectories[i], new_ids[row, :keep].tolist(), log_probs[row, :keep].tolist())

    # ------------------------------------------------------------------ result

    def _rollout(self, first: Rollout, trajectories: list[_Trajectory]) -> Rollout:
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
        return Rollout(rows=first.rows, group_ids=first.group_ids, prompt_inputs=first.prompt_inputs,
                       completion_ids=ids, completion_mask=trained, texts=[t.last_message for t in trajectories],
                       extras=extras)
