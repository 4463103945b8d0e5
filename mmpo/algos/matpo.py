"""MATPO: one model plays a planner and its workers, trained jointly by GRPO (docs/matpo.md).

The planner sees the user's question and one tool, ``subagent(subtask)``. A call starts a worker: the same
model, with a worker system prompt and a fresh context (the main question and the subtask), runs its own
multi-turn tool rollout (:mod:`mmpo.vlm.multiturn`) and its last message (the summary, ``</think>`` part
dropped) returns to the planner as the tool's answer: context, not loss, for the planner.

Credit (official ``mzf666/MATPO``, ``verl/protocol.py``):

- the reward is scored on the planner's final answer only and the group-relative (GRPO) advantage is computed
  over the planner rollouts of each question;
- every worker rollout inherits its planner rollout's advantage (``broadcast_advantage_return_tensor_by_reqs_ids``;
  :func:`broadcast_to_workers`);
- the worker rollouts are trained in the same loss, and the ``seq-mean-*`` aggregations divide by the number of
  planner rollouts, not of all sequences (``get_num_valid_seqs`` and ``core_algos.agg_loss(num_valid_seqs)``;
  :func:`planner_sequence_count`). ``token-mean`` (the official default) divides by every trained token.

One rollout holds the planner trajectories first (grouped by question, as GRPO's), then the worker trajectories;
``extras["matpo_parent"]`` is -1 on a planner row and the index of its planner row on a worker row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmpo.algos.agent import AgentGRPOModule, agent_validation_metrics
from mmpo.algos.config import require
from mmpo.tools.env import INVALID_CALL_NAME, StepResult, ToolEnvironment, ToolStats
from mmpo.tools.parsing import MalformedCall, ToolCallParser
from mmpo.training.config import as_config
from mmpo.training.step_state import StepState
from mmpo.vlm.multiturn import MultiTurnEngine
from mmpo.vlm.rollout import Rollout, concat_rollouts

SUBAGENT_TOOL = "subagent"
SUBAGENT_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": SUBAGENT_TOOL,
        "description": "Delegate a subtask to a worker agent that can use tools; it answers with a short summary.",
        "parameters": {"type": "object",
                       "properties": {"subtask": {"type": "string", "description": "The subtask for the worker."}},
                       "required": ["subtask"]},
    },
}
DEFAULT_WORKER_SYSTEM_PROMPT = ("You are a worker agent. Solve the subtask you are given with the tools, then reply "
                                "with a short summary of the result for the planner.")


def worker_request(main_query: str, subtask: str) -> str:
    """The worker's first user message: the main task as context, then its subtask (the layout of the official
    ``create_subagent_tool_request``: [CONTEXT] / [YOUR ASSIGNED SUBTASK] / [INSTRUCTIONS])."""
    return (f"[CONTEXT]\nYou are a sub-agent working on a part of a larger task.\nThe main task is: \"{main_query}\"\n\n"
            f"[YOUR ASSIGNED SUBTASK]\nYour current subtask is: \"{subtask}\"\n\n"
            "[INSTRUCTIONS]\nComplete your subtask with the main task in mind. Your answer is returned to the "
            "planner agent to help it decide its next step.")


def worker_summary(text: str, *, max_chars: int, drop_think: bool = True) -> str:
    """What the planner gets back: the worker's last message, the part before ``</think>`` dropped (official
    ``delete_think_from_subagent_tools``), cut to ``max_chars`` (official ``tool_response_cut_off_length``)."""
    if drop_think:
        text = text.split("</think>")[-1].lstrip("\n")
    return text[:max_chars]


@dataclass(frozen=True)
class MATPOConfig:
    """Planner / worker settings (``model.init_args.matpo`` in YAML); the worker's tools are ``agent.tools``.

    Attributes:
        worker_system_prompt: the workers' system prompt (the tool schemas are appended to it).
        worker_max_turns: model turns of one worker rollout.
        worker_max_total_tokens: completion tokens (model and tool) of one worker rollout.
        summary_max_chars: longest worker summary given to the planner.
        drop_think: drop the worker's text up to ``</think>`` from its summary (official script: True).
        train_workers: worker rollouts in the loss (official ``include_subagent_tool_rollout_in_loss: True``).
    """

    worker_system_prompt: str = DEFAULT_WORKER_SYSTEM_PROMPT
    worker_max_turns: int = 3
    worker_max_total_tokens: int = 256
    summary_max_chars: int = 2000
    drop_think: bool = True
    train_workers: bool = True

    def __post_init__(self) -> None:
        for name in ("worker_max_turns", "worker_max_total_tokens", "summary_max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"matpo.{name} must be an integer >= 1, got {value!r}")


@dataclass
class WorkerRun:
    """One worker rollout started by a planner call: its summary and its one-row rollout and transcript."""

    summary: str
    rollout: Rollout
    transcript: list[dict[str, str]] = field(default_factory=list)


class PlannerEnvironment:
    """The planner's environment: each ``subagent`` call runs ``run_worker(main_query, subtask)`` and answers
    with the worker's summary as a ``tool`` message; a malformed call, another tool or a missing ``subtask`` is a
    short error message (no worker runs); a message without a call ends the episode. ``workers`` keeps every run."""

    def __init__(self, run_worker: Callable[[Mapping[str, Any], str], WorkerRun], parser: ToolCallParser, *,
                 stats: ToolStats | None = None, max_calls_per_turn: int = 4) -> None:
        self.tools = [SUBAGENT_SCHEMA]
        self.run_worker = run_worker
        self.parser = parser
        self.stats = stats if stats is not None else ToolStats()
        self.max_calls_per_turn = max_calls_per_turn
        self.row: Mapping[str, Any] = {}
        self.workers: list[WorkerRun] = []

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row, self.workers = row, []
        return str(row["problem"])

    def step(self, assistant_message: str) -> StepResult:
        observation = []
        for index, call in enumerate(self.parser.parse(assistant_message)):
            if isinstance(call, MalformedCall):
                text, name = f"Error: {call.error}", INVALID_CALL_NAME
            elif call.name != SUBAGENT_TOOL:
                text, name = f"Error: unknown tool {call.name!r}; available: ['{SUBAGENT_TOOL}']", INVALID_CALL_NAME
            elif index >= self.max_calls_per_turn:
                text, name = f"Error: at most {self.max_calls_per_turn} tool calls per turn", SUBAGENT_TOOL
            elif not isinstance(call.arguments.get("subtask"), str) or not call.arguments["subtask"].strip():
                text, name = "Error: subagent needs a non-empty string argument 'subtask'", SUBAGENT_TOOL
            else:
                run = self.run_worker(self.row, call.arguments["subtask"])
                self.workers.append(run)
                self.stats.add(SUBAGENT_TOOL)
                observation.append({"role": "tool", "name": SUBAGENT_TOOL, "content": run.summary})
                continue
            self.stats.add(name, error=True)
            observation.append({"role": "tool", "name": name, "content": text})
        return StepResult(observation, done=not observation, info={"tool_calls": len(observation)})


def broadcast_to_workers(planner_values: Tensor, parents: Tensor) -> Tensor:
    """(N,) values of a MATPO rollout from the (P,) values of its planner rows: planner row ``i`` (``parents[i]``
    = -1, the first P rows) keeps its own, a worker row takes its planner's (``planner_values[parents[i]]``)."""
    parents = parents.to(planner_values.device)
    planners = int((parents < 0).sum())
    if planners != planner_values.shape[0] or bool((parents[:planners] >= 0).any()):
        raise ValueError(f"a MATPO rollout holds its {planner_values.shape[0]} planner rows first; got parents "
                         f"{parents.tolist()}")
    source = torch.where(parents < 0, torch.arange(len(parents), device=parents.device), parents)
    if bool((source >= planners).any()):
        raise ValueError(f"a worker row names a parent that is not a planner row: {parents.tolist()}")
    return planner_values[source]


def planner_sequence_count(parents: Tensor) -> int:
    """The official ``num_valid_seqs``: the planner rollouts (not from the subagent tool) among ``parents``."""
    return int((parents < 0).sum())


class MATPOModule(AgentGRPOModule):
    """MATPO (see the module docstring): the planner calls ``subagent``, workers use ``agent.tools``.

    Args:
        matpo: worker prompt and budgets (:class:`MATPOConfig`).
        **kwargs: every ``AgentGRPOModule`` setting (``agent.tools`` are the workers' tools; ``agent.max_turns``
            and ``agent.max_total_tokens`` the planner's budgets).

    Logged per step, besides the agent's: ``matpo/workers_per_planner`` (worker rollouts per planner rollout),
    ``matpo/worker_tokens_mean`` (trained tokens per worker rollout), ``tools/subagent/calls``.
    """

    config_groups = (*AgentGRPOModule.config_groups, "matpo")

    def __init__(self, model_path: str, matpo: MATPOConfig = MATPOConfig(), **kwargs: Any) -> None:
        self.matpo = as_config(matpo, MATPOConfig())
        super().__init__(model_path, **kwargs)
        self.worker_engine = MultiTurnEngine(self.engine, max_turns=self.matpo.worker_max_turns,
                                             max_total_tokens=self.matpo.worker_max_total_tokens,
                                             max_tokens_per_turn=self.sampling.max_new_tokens)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        require(self.optim.minibatch_size is None, "matpo: optim.minibatch_size must be null (the number of worker "
                "rollouts varies per step: one optimizer step per rollout)")
        require(self.optim.micro_batch_size in (None, 1), "matpo: optim.micro_batch_size must be null or 1 (the "
                "rollout size varies with the number of worker rollouts)")
        require(not (self.advantage.dynamic_sampling and self.advantage.dynamic_sampling_retries),
                "matpo: advantage.dynamic_sampling_retries is not supported (resampling would drop the workers)")

    # ------------------------------------------------------------------ rollout

    def environments(self, count: int, *, do_sample: bool = True) -> list[PlannerEnvironment]:  # type: ignore[override]
        def run_worker(row: Mapping[str, Any], subtask: str) -> WorkerRun:
            return self.run_worker(row, subtask, do_sample=do_sample)

        return [PlannerEnvironment(run_worker, self.parser, stats=self.tool_stats,
                                   max_calls_per_turn=self.agent.max_calls_per_turn) for _ in range(count)]

    def run_worker(self, row: Mapping[str, Any], subtask: str, *, do_sample: bool = True) -> WorkerRun:
        """One worker rollout of ``subtask`` (the same model, the worker system prompt, ``agent.tools``)."""
        worker_row = {"id": f"{row.get('id')}/worker", "problem": worker_request(str(row["problem"]), subtask),
                      "system_prompt": self.matpo.worker_system_prompt}
        env = ToolEnvironment(self.tools, self.sandbox, parser=self.parser, stats=self.tool_stats,
                              max_calls_per_turn=self.agent.max_calls_per_turn)
        rollout = self.worker_engine.generate([worker_row], [env], num_samples=1, temperature=self.sampling.temperature,
                                              top_p=self.sampling.top_p, do_sample=do_sample)
        summary = worker_summary(rollout.texts[0], max_chars=self.matpo.summary_max_chars,
                                 drop_think=self.matpo.drop_think)
        return WorkerRun(summary, rollout, self.worker_engine.last_transcripts[0])

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G planner trajectories per row (grouped contiguously), then every worker trajectory they started."""
        rows = list(rows)
        envs = self.environments(len(rows) * self.sampling.num_generations)
        planner = self.multiturn.generate(rows, envs, num_samples=self.sampling.num_generations,
                                          temperature=self.sampling.temperature, top_p=self.sampling.top_p)
        planner.extras["matpo_parent"] = torch.full((len(planner),), -1, dtype=torch.long)
        transcripts = list(self.multiturn.last_transcripts)
        parts = [planner]
        if self.matpo.train_workers:
            for parent, env in enumerate(envs):
                for run in env.workers:
                    run.rollout.extras["matpo_parent"] = torch.tensor([parent], dtype=torch.long)
                    parts.append(run.rollout)
                    transcripts.append(run.transcript)
        rollout = concat_rollouts(parts) if len(parts) > 1 else planner
        self.multiturn.last_transcripts = transcripts  # the rollout log gets the workers' trajectories too
        return rollout

    # ------------------------------------------------------------------ credit

    @staticmethod
    def _planner_rows(rollout: Rollout) -> Tensor:
        return torch.nonzero(rollout.extras["matpo_parent"] < 0).flatten()

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The planner's final answers are scored; each worker row gets its planner's reward (official
        ``broadcast_reward_tensor_by_reqs_ids``)."""
        planners = rollout.select(self._planner_rows(rollout))
        total, metrics = super().compute_rewards(planners)
        return broadcast_to_workers(total, rollout.extras["matpo_parent"]), metrics

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout,
                           ) -> tuple[Tensor, dict[str, float]]:
        """The estimator over the planner rows (grouped by question), broadcast to their workers."""
        rows = self._planner_rows(rollout)
        advantages, metrics = super().compute_advantages(rewards[rows.to(rewards.device)], group_ids[rows],
                                                         rollout.select(rows))
        if advantages.ndim != 1:
            raise ValueError(f"matpo: advantage.name {self.advantage.name!r} gives per-token advantages; MATPO "
                             "broadcasts one advantage per planner rollout (use a sequence-level estimator: grpo, ...)")
        return broadcast_to_workers(advantages, rollout.extras["matpo_parent"]), metrics

    def filter_groups(self, rewards: Tensor, rollout: Rollout) -> tuple[Tensor | None, dict[str, float]]:
        """The group filter on the planner rows; a worker row stays or goes with its planner."""
        rows = self._planner_rows(rollout)
        keep, metrics = super().filter_groups(rewards[rows.to(rewards.device)], rollout.select(rows))
        if keep is None:
            return None, metrics
        return broadcast_to_workers(keep, rollout.extras["matpo_parent"]), metrics

    def loss_sequence_count(self, rollout: Rollout, index: Tensor, sequences: Tensor) -> Tensor:
        """The planner rows of the minibatch, over every rank, at least 1 (official ``agg_loss``:
        ``max(1, num_valid_seqs)``)."""
        count = torch.tensor(float(planner_sequence_count(rollout.extras["matpo_parent"][index.cpu()])),
                             device=sequences.device)
        return self.update_engine.sum_over_ranks(count).clamp(min=1.0)

    # ------------------------------------------------------------------ logs

    def end_step(self, state: StepState) -> None:
        rollout = state.rollout
        if rollout is not None and "matpo_parent" in rollout.extras:
            parents = rollout.extras["matpo_parent"].cpu()
            workers = parents >= 0
            state.metrics["matpo/workers_per_planner"] = float(workers.sum()) / max(int((~workers).sum()), 1)
            trained = rollout.completion_mask.cpu().sum(-1).float()
            state.metrics["matpo/worker_tokens_mean"] = float(trained[workers].mean()) if bool(workers.any()) else 0.0
        super().end_step(state)

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Greedy planner and workers on held-out rows (``val/accuracy``, ``val/format``, ``val/tool_calls``)."""
        self.log_dict(agent_validation_metrics(self.multiturn, self.environments(len(batch), do_sample=False),
                                               list(batch), timeout_s=self.rewards.timeout_s),
                      batch_size=len(batch), sync_dist=True, prog_bar=True)


__all__ = ["DEFAULT_WORKER_SYSTEM_PROMPT", "MATPOConfig", "MATPOModule", "PlannerEnvironment", "SUBAGENT_SCHEMA",
           "SUBAGENT_TOOL", "WorkerRun", "broadcast_to_workers", "planner_sequence_count", "worker_request",
           "worker_summary"]
