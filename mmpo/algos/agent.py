"""GRPO and SFT with tools: multi-turn rollouts in which the model calls tools (docs/agents.md).

``AgentGRPOModule`` is ``GRPOModule`` whose ``build_rollout`` runs the multi-turn engine
(:mod:`mmpo.vlm.multiturn`) with one :class:`~mmpo.tools.env.ToolEnvironment` per trajectory: tool
responses are context, not loss (holes in the completion mask), so every estimator, filter and loss of
GRPO applies unchanged. ``AgentSFTModule`` teaches the tool-use format on the rows' ``tool_trace``
conversations (tool responses masked out of the loss in the same way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.algos.sft import SFTModule
from mmpo.tools.env import ToolEnvironment, ToolStats
from mmpo.tools.functions import Tool, load_tools, tool_system_prompt
from mmpo.tools.parsing import make_parser
from mmpo.tools.sandbox import SandboxLimits, ToolSandbox
from mmpo.training.config import as_config
from mmpo.training.step_state import StepState
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, encode_observation
from mmpo.vlm.processing import append_row_images, default_system_prompt, encode_prompts
from mmpo.vlm.rollout import Rollout


@dataclass(frozen=True)
class AgentConfig:
    """Tools and multi-turn limits (``model.init_args.agent`` in YAML).

    Attributes:
        tools: built-in names (``calculator``, ``python``, ``image_zoom_in_tool``, ``codebook``) or
            ``path/file.py:fn`` / ``module:fn``; checked (imported, JSON schema built from type hints and
            docstring) before the model loads.
        parser: tool-call format: ``hermes`` (Qwen's ``<tool_call>{...}</tool_call>``) or ``file.py:factory``.
        max_turns: model turns per trajectory (``sampling.max_new_tokens`` bounds each turn).
        max_total_tokens: completion tokens per trajectory, model and tool tokens together.
        max_calls_per_turn: tool calls answered per model turn; more are errors.
        tool_timeout_s: wall-clock deadline of one tool call (killed when missed).
        tool_cpu_s: CPU seconds of one call (``RLIMIT_CPU``).
        tool_memory_mb: address-space limit of one call (``RLIMIT_AS``).
        tool_max_output_chars: longest tool output given to the model; longer is an error.
        tool_parallel: tool calls running at once.
        rollout_log: JSONL file that gets every trajectory of every step (turns, tool calls, reward, messages);
            None = ``<trainer.default_root_dir>/rollouts.jsonl`` (no log without a trainer).
    """

    tools: list[str] = field(default_factory=lambda: ["calculator"])
    parser: str = "hermes"
    max_turns: int = 3
    max_total_tokens: int = 256
    max_calls_per_turn: int = 4
    tool_timeout_s: float = 10.0
    tool_cpu_s: int = 5
    tool_memory_mb: int = 1024
    tool_max_output_chars: int = 2000
    tool_parallel: int = 8
    rollout_log: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_calls_per_turn", "tool_cpu_s", "tool_memory_mb",
                     "tool_max_output_chars", "tool_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"agent.{name} must be an integer >= 1, got {value!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"agent.tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        if not isinstance(self.tools, (list, tuple)):
            raise ValueError(f"agent.tools must be a list of tool names or specs, got {self.tools!r}")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.tool_timeout_s, cpu_time_s=self.tool_cpu_s, memory_mb=self.tool_memory_mb,
                             max_output_chars=self.tool_max_output_chars, max_parallel=self.tool_parallel)


class AgentGRPOModule(GRPOModule):
    """GRPO on multi-turn tool-use rollouts (see the module docstring).

    Args:
        agent: tools and multi-turn limits (:class:`AgentConfig`).
        **kwargs: every ``GRPOModule`` setting; ``sampling.max_new_tokens`` is the budget of one model turn.

    Logged per step, besides GRPO's: ``tools/<name>/calls``, ``tools/<name>/errors``, ``tools/<name>/timeouts``
    (``invalid``: unparseable calls and unknown tools), ``agent/turns_mean``, ``agent/tool_calls_mean``,
    ``agent/env_tokens_mean`` (tool tokens per trajectory, out of the loss); each trajectory goes to
    ``agent.rollout_log``.
    """

    config_groups = (*GRPOModule.config_groups, "agent")
    multi_turn_engines: tuple[str, ...] = ("hf", "vllm")
    """The rollout engines this module's multi-turn rollouts run on (vLLM: text LMs and VLMs, ARPO's branching and
    MATPO's planners and workers included; docs/vllm.md)."""

    def __init__(self, model_path: str, agent: AgentConfig = AgentConfig(), **kwargs: Any) -> None:
        self.agent = as_config(agent, AgentConfig())
        super().__init__(model_path, **kwargs)
        self.tools = load_tools(self.agent.tools, "agent.tools")
        self.parser = make_parser(self.agent.parser)
        self.sandbox = ToolSandbox(self.agent.limits())
        self.tool_stats = ToolStats()
        self.multiturn = MultiTurnEngine(self.engine, max_turns=self.agent.max_turns,
                                         max_total_tokens=self.agent.max_total_tokens,
                                         max_tokens_per_turn=self.sampling.max_new_tokens)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        require(self.rollout_engine.name in self.multi_turn_engines,
                f"{type(self).__name__}: multi-turn rollouts run on rollout_engine: "
                f"{' or '.join(self.multi_turn_engines)}")
        load_tools(self.agent.tools, "agent.tools")  # a bad tool fails here, before the model loads
        make_parser(self.agent.parser)

    def environments(self, count: int) -> list[ToolEnvironment]:
        return [ToolEnvironment(self.tools, self.sandbox, parser=self.parser, stats=self.tool_stats,
                                max_calls_per_turn=self.agent.max_calls_per_turn) for _ in range(count)]

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G multi-turn tool-use trajectories per row, grouped contiguously."""
        rows = list(rows)
        return self.multiturn.generate(rows, self.environments(len(rows) * self.sampling.num_generations),
                                       num_samples=self.sampling.num_generations,
                                       temperature=self.sampling.temperature, top_p=self.sampling.top_p)

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The reward functions on each trajectory's last message, plus the environment's step rewards."""
        total, metrics = super().compute_rewards(rollout)
        env_rewards = rollout.extras.get("env_rewards")
        if env_rewards is not None:
            total = total + env_rewards.to(total)
            metrics["rewards/env/mean"] = float(env_rewards.mean())
        return total, metrics

    def end_step(self, state: StepState) -> None:
        rollout = state.rollout
        if rollout is not None and "turns" in rollout.extras:
            from mmpo.vlm.rollout import completion_attention_mask

            state.metrics["agent/turns_mean"] = float(rollout.extras["turns"].float().mean())
            state.metrics["agent/tool_calls_mean"] = float(rollout.extras["tool_calls"].float().mean())
            holes = completion_attention_mask(rollout).sum(-1) - rollout.completion_mask.sum(-1)
            state.metrics["agent/env_tokens_mean"] = float(holes.float().mean())
            self._log_rollouts(state)
        state.metrics.update(self.tool_stats.metrics())
        self.tool_stats.reset()

    def _rollout_log_path(self) -> Path | None:
        if self.agent.rollout_log is not None:
            return Path(self.agent.rollout_log)
        return Path(self.trainer.default_root_dir) / "rollouts.jsonl" if self._trainer is not None else None

    def _log_rollouts(self, state: StepState) -> None:
        path = self._rollout_log_path()
        transcripts = self.multiturn.last_transcripts
        rollout = state.rollout
        if path is None or len(transcripts) != len(rollout):  # e.g. dynamic-sampling refills replaced groups
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        rewards = state.rewards.tolist() if state.rewards is not None else [None] * len(rollout)
        with path.open("a") as handle:
            for i, messages in enumerate(transcripts):
                handle.write(json.dumps({
                    "step": state.step, "id": rollout.rows[i].get("id"), "group": int(rollout.group_ids[i]),
                    "turns": int(rollout.extras["turns"][i]), "tool_calls": int(rollout.extras["tool_calls"][i]),
                    "reward": rewards[i], "messages": messages}) + "\n")

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Greedy multi-turn accuracy on held-out rows (``val/accuracy``, ``val/format``, ``val/tool_calls``)."""
        self.log_dict(agent_validation_metrics(self.multiturn, self.environments(len(batch)), list(batch),
                                               timeout_s=self.rewards.timeout_s),
                      batch_size=len(batch), sync_dist=True, prog_bar=True)

    def teardown(self, stage: str) -> None:
        self.sandbox.shutdown()
        super().teardown(stage)


def agent_validation_metrics(engine: MultiTurnEngine, envs: Sequence[ToolEnvironment], rows: list,
                             *, timeout_s: float | None) -> dict[str, float]:
    """Greedy multi-turn rollouts -> accuracy and format of the last message, and tool calls per row."""
    from mmpo.rewards import compute_rewards

    rollout = engine.generate(rows, envs, num_samples=1, do_sample=False)
    _, per_fn, _ = compute_rewards({"accuracy": 1.0, "format": 1.0}, rollout.texts, rollout.rows, timeout_s=timeout_s)
    return {"val/accuracy": float(per_fn["accuracy"].mean()), "val/format": float(per_fn["format"].mean()),
            "val/tool_calls": float(rollout.extras["tool_calls"].float().mean())}


def encode_tool_traces(processor: Any, traces: Sequence[Sequence[Mapping[str, Any]]],
                       ) -> tuple[Tensor, Tensor, Tensor, list[list[tuple[Tensor, Tensor]]]]:
    """Conversations after the prompt -> ``(ids, loss_mask, attention_mask)`` (N, T), right-padded, and each
    conversation's tool-answer images (``(pixel_values, grid)``, in order; empty without image tools).

    Assistant messages are their tokens + the turn-end token (in the loss); each run of other messages (tool
    answers) is what the chat template writes after a turn (:func:`~mmpo.vlm.multiturn.encode_observation`,
    out of the loss; an image becomes its vision tokens): the same tokens a multi-turn rollout holds."""
    from mmpo.vlm.factory import turn_end_token_id

    tokenizer = processor.tokenizer
    end = turn_end_token_id(tokenizer)
    rows: list[tuple[list[int], list[int]]] = []
    images: list[list[tuple[Tensor, Tensor]]] = []
    for trace in traces:
        ids: list[int] = []
        trained: list[int] = []
        pending: list[Mapping[str, Any]] = []
        images.append([])
        for message in trace:
            if message["role"] != "assistant":
                pending.append(message)
                continue
            if pending:
                observation, observed_images = encode_observation(processor, pending)
                images[-1] += observed_images
                ids += observation
                trained += [0] * len(observation)
                pending = []
            tokens = list(tokenizer(message["content"], add_special_tokens=False)["input_ids"]) + [end]
            ids += tokens
            trained += [1] * len(tokens)
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    out_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        out_ids[i, :len(ids)] = torch.tensor(ids)
        loss_mask[i, :len(ids)] = torch.tensor(trained)
        attention[i, :len(ids)] = 1
    return out_ids, loss_mask, attention, images


class AgentSFTModule(SFTModule):
    """SFT warm-up on the rows' ``tool_trace`` conversations (``calc`` and ``zoom`` rows carry one; a zoom trace's
    crop is an image, encoded as vision tokens out of the loss): the prompt advertises
    ``tools`` as the GRPO stage's does, tool answers are context, not loss. A row may carry its own
    ``tool_schemas`` (a list of JSON schemas, ``[]`` for none) instead: one SFT run then teaches several roles, each
    with the prompt its rollout shows (MATPO's planner with ``subagent``, its workers and a single agent with
    ``lookup``; a dialogue with no tools).

    Args:
        tools: the tools the prompt advertises (names or specs, as ``AgentConfig.tools``).
        val_max_turns: model turns of the greedy validation rollout (its token budget:
            (``val_max_turns`` + 1) x ``val_max_new_tokens``).
        **kwargs: every ``SFTModule`` setting.
    """

    def __init__(self, model_path: str, tools: list[str] | None = None, val_max_turns: int = 3,
                 **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        self.tools: list[Tool] = load_tools(self.hparams.tools or ["calculator"], "tools")

    def _validate_settings(self) -> None:
        super()._validate_settings()
        load_tools(self.hparams.tools or ["calculator"], "tools")
        require(self.hparams.val_max_turns >= 1, f"val_max_turns must be >= 1, got {self.hparams.val_max_turns}")

    def _prompt_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for row in rows:
            require("tool_trace" in row, f"row {row.get('id')!r} has no tool_trace (AgentSFTModule trains on tool-use "
                    "conversations: use a task that provides them, e.g. calc or zoom)")
            system = row.get("system_prompt", self.system_prompt)
            system = default_system_prompt() if system == "default" else system
            schemas = row.get("tool_schemas", [t.schema for t in self.tools])
            out.append({**row, "system_prompt": tool_system_prompt(system, schemas)})
        return out

    def sft_loss(self, rows: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, dict[str, float]]:
        h = self.hparams
        rows = self._prompt_rows(rows)
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=h.max_prompt_length)
        ids, loss_mask, attention, images = encode_tool_traces(self.processor, [row["tool_trace"] for row in rows])
        prompts = append_row_images(prompts, images)
        prompts = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}
        log_probs, _ = completion_log_probs(self.model, prompts, ids.to(self.device), attention.to(self.device),
                                            chunk_size=h.logprob_chunk_size)
        mask = loss_mask.to(self.device, log_probs.dtype)
        tokens = mask.sum()
        loss = -(log_probs * mask).sum() / tokens.clamp(min=1.0)
        return loss, {"losses/sft": float(loss.detach()), "response/length_mean": float(tokens) / len(rows)}

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Teacher-forced ``val/loss`` and greedy multi-turn ``val/accuracy`` with the real tools."""
        rows = list(batch)
        loss, _ = self.sft_loss(rows)
        if not hasattr(self, "_val_sandbox"):
            self._val_sandbox = ToolSandbox(SandboxLimits(timeout_s=10.0))
        per_turn = int(self.hparams.val_max_new_tokens)
        turns = int(self.hparams.val_max_turns)
        engine = MultiTurnEngine(self.engine, max_turns=turns, max_total_tokens=(turns + 1) * per_turn,
                                 max_tokens_per_turn=per_turn)
        envs = [ToolEnvironment(self.tools, self._val_sandbox) for _ in rows]
        metrics = agent_validation_metrics(engine, envs, rows, timeout_s=self.hparams.reward_timeout_s)
        metrics["val/loss"] = float(loss)
        self.log_dict(metrics, batch_size=len(rows), sync_dist=True, prog_bar=True)

    def teardown(self, stage: str) -> None:
        if hasattr(self, "_val_sandbox"):
            self._val_sandbox.shutdown()
        super().teardown(stage)


__all__ = ["AgentConfig", "AgentGRPOModule", "AgentSFTModule", "agent_validation_metrics", "encode_tool_traces"]
