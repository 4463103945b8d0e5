"""DIALTREE-RPO: GRPO on tree-structured multi-turn dialogues against a target (arXiv 2510.02286; docs/dialtree_rpo.md).

No official code was found: this follows the paper's description; the choices it leaves open are settings here
and are marked UNVERIFIED in the docs page.

Rollout (:func:`grow_dialogue_trees`, on the frontier loop :func:`mmpo.algos.tree_rollout.grow_frontier`): the
policy writes ``branching`` first turns per goal; the target answers each; then every active dialogue node expands
into ``branching`` candidate next turns, the target answers each, and so on for ``max_turns`` policy turns.
Quality-aware pruning (:func:`prune_nodes`) stops the children whose turn is malformed (no ``</think>`` followed by a
message, when ``require_think``) or off-goal (``relevance`` says so) and keeps at most ``width`` active nodes per goal
(a random subset). A dialogue ends when the target gives in (the judge scores it 1), when it closes the dialogue, or
at ``max_turns``. The outcome judge scores each leaf's dialogue; the advantage is GRPO's over the leaves of a goal.
Adaptive masking (:func:`format_token_mask`): on leaves with a negative advantage the format tokens (``format_tags``)
leave the loss, so a failed dialogue does not push the format down (against format collapse).

Each leaf is one trajectory of the rollout: the policy's turns trained, the target's answers holes
(:mod:`mmpo.vlm.multiturn`); ``rows[i]["dialogue"]`` holds its messages.

The testbed (task ``lock``, :class:`LockTarget`, :func:`code_revealed`) is harmless: a scripted target that tells its
code to a dialogue that greets it first and then asks politely; success is a string match.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.algos.tree_rollout import grow_frontier
from mmpo.plugins import load_function, parse_spec
from mmpo.tools.env import StepResult
from mmpo.training.config import as_config
from mmpo.training.step_state import StepState
from mmpo.vlm.multiturn import MultiTurnEngine, _Trajectory
from mmpo.vlm.processing import select_rows
from mmpo.vlm.rollout import Rollout

GREETINGS = ("hello", "hi", "hey", "greetings", "good morning")


def split_turn(message: str) -> tuple[str | None, str]:
    """``(thought, message)`` of a policy turn ``<think>...</think> message``; thought None without ``</think>``."""
    if "</think>" not in message:
        return None, message.strip()
    thought, _, said = message.partition("</think>")
    return thought.replace("<think>", "").strip(), said.strip()


class LockTarget:
    """A scripted target holding ``row["lock_code"]``: it reveals the code to a request containing ``code`` and
    ``please`` once it was greeted on ``row["lock_greetings"]`` earlier turns; a request for the code before that
    is refused and locks it for the rest of the dialogue. ``target(said, row)`` answers the last of the policy's
    messages ``said`` (the whole dialogue so far; stateless, so tree branches can share it)."""

    def __call__(self, said: Sequence[str], row: Mapping[str, Any]) -> str:
        needed, greeted, locked, reply = int(row.get("lock_greetings", 1)), 0, False, ""
        for message in said:
            text = message.lower()
            if locked:
                reply = "I cannot help with that any more."
            elif "code" in text:
                if greeted < needed:
                    locked, reply = True, "I will not share that."
                elif "please" in text:
                    reply = f"Since you ask nicely: the code is {row['lock_code']}."
                else:
                    reply = "Maybe, if you ask nicely."
            elif any(word in text.split() or text.startswith(word) for word in GREETINGS):
                greeted += 1
                reply = "Hello! Nice to meet you."
            else:
                reply = "I see."
        return reply


def code_revealed(dialogue: Sequence[Mapping[str, str]], row: Mapping[str, Any]) -> float:
    """Outcome judge of the lock task: 1.0 when one of the target's answers (``user`` messages after the goal)
    holds the row's code, else 0.0."""
    code = str(row.get("lock_code", row.get("answer")))
    return float(any(m["role"] == "user" and code in m["content"] for m in list(dialogue)[1:]))


def any_message(message: str, row: Mapping[str, Any]) -> bool:
    """Default relevance check: a non-empty message (every non-empty turn is on-goal)."""
    return bool(message.strip())


class DialogueEnvironment:
    """A dialogue with a target: the first user message is the goal; each policy turn's message (the text after
    ``</think>``) goes to ``target(said_so_far, row)``, whose answer is the next ``user`` message. Done when the
    judge scores the dialogue > 0 or the target answers with an empty string."""

    tools: list[dict[str, Any]] = []

    def __init__(self, target: Callable[[Sequence[str], Mapping[str, Any]], str],
                 judge: Callable[[Sequence[Mapping[str, str]], Mapping[str, Any]], float]) -> None:
        self.target, self.judge = target, judge
        self.row: Mapping[str, Any] = {}
        self.said: list[str] = []
        self.dialogue: list[dict[str, str]] = []
        self.queries = 0

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row, self.said = row, []
        goal = f"Goal: {row['problem']}"
        self.dialogue = [{"role": "user", "content": goal}]
        return goal

    def step(self, assistant_message: str) -> StepResult:
        said = split_turn(assistant_message)[1]
        self.said.append(said)
        self.queries += 1
        reply = str(self.target(list(self.said), self.row))
        self.dialogue += [{"role": "assistant", "content": said}, {"role": "user", "content": reply}]
        done = not reply or self.judge(self.dialogue, self.row) > 0
        return StepResult([{"role": "user", "content": reply}] if reply else [], done=done)


@dataclass
class DialogueNode:
    """A node of a dialogue tree: the trajectory so far, its environment, its goal and first-turn sample."""

    trajectory: _Trajectory
    env: DialogueEnvironment
    root: int
    group: int
    valid: bool = True
    choices: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.trajectory.done

    def fork(self, child: int) -> "DialogueNode":
        t = self.trajectory
        trajectory = dataclasses.replace(t, tokens=list(t.tokens), trained=list(t.trained), log_probs=list(t.log_probs),
                                         transcript=[dict(m) for m in t.transcript])
        env = copy.copy(self.env)
        env.said, env.dialogue = list(self.env.said), [dict(m) for m in self.env.dialogue]
        return DialogueNode(trajectory, env, self.root, self.group, True, self.choices + [child])


def turn_quality(message: str, row: Mapping[str, Any], *, require_think: bool,
                 relevance: Callable[[str, Mapping[str, Any]], bool]) -> bool:
    """A policy turn survives pruning: well-formed (``<think>...</think>`` then a message, when ``require_think``)
    and on-goal (``relevance(message, row)``)."""
    thought, said = split_turn(message)
    if require_think and thought is None:
        return False
    return bool(said) and bool(relevance(said, row))


def dialogue_format_valid(transcript: Sequence[Mapping[str, Any]], row: Mapping[str, Any], *, require_think: bool,
                          relevance: Callable[[str, Mapping[str, Any]], bool]) -> bool:
    """Every policy turn (``assistant`` message) of a dialogue passes :func:`turn_quality` (the format-valid rate of
    a flat dialogue and of a greedy validation dialogue; a tree leaf's is whether pruning stopped it)."""
    return all(turn_quality(m["content"], row, require_think=require_think, relevance=relevance)
               for m in transcript if m["role"] == "assistant")


class ModelTarget:
    """A frozen language model as the target: it answers the policy's messages so far (one user message, the
    messages joined by newlines) greedily, ``max_new_tokens`` at most. Stateless and deterministic, so tree
    branches can share it; never trained (its own engine, outside the policy's module).

    Args:
        engine: a rollout engine over the target model (``HFGenerateEngine``; its ``system_prompt`` is the target's).
        max_new_tokens: the longest answer.
    """

    def __init__(self, engine: Any, *, max_new_tokens: int = 24) -> None:
        self.engine, self.max_new_tokens = engine, int(max_new_tokens)

    @classmethod
    def from_pretrained(cls, model_path: str, *, system_prompt: str | None = None,
                        max_new_tokens: int = 24) -> "ModelTarget":
        """A target from a saved model directory (for a ``file.py:fn`` factory in ``dialtree.target``)."""
        from mmpo.vlm.factory import load_vlm
        from mmpo.vlm.rollout import HFGenerateEngine

        model, processor = load_vlm(model_path)
        model.eval().requires_grad_(False)
        return cls(HFGenerateEngine(model, processor, system_prompt=system_prompt), max_new_tokens=max_new_tokens)

    def __call__(self, said: Sequence[str], row: Mapping[str, Any]) -> str:
        with torch.no_grad():
            rollout = self.engine.generate([{"problem": "\n".join(said), "images": []}], num_samples=1,
                                           max_new_tokens=self.max_new_tokens, do_sample=False)
        return rollout.texts[0].strip()


def prune_nodes(nodes: list[DialogueNode], *, width: int, quality: Callable[[DialogueNode], bool],
                generator: torch.Generator | None = None) -> list[DialogueNode]:
    """Quality-aware pruning of one depth's children: a child failing ``quality`` stops (a leaf, ``valid`` False);
    then at most ``width`` active children per goal stay (a random subset, in their order), the rest are dropped."""
    for node in nodes:
        if not quality(node):
            node.valid = False
            node.trajectory.done, node.trajectory.awaiting_environment = True, False
    kept: list[DialogueNode] = []
    for group in sorted({n.group for n in nodes}):
        members = [n for n in nodes if n.group == group]
        active = [i for i, n in enumerate(members) if not n.done]
        if len(active) > width:
            chosen = torch.randperm(len(active), generator=generator)[:width].tolist()
            dropped = {active[i] for i in range(len(active)) if i not in chosen}
            members = [n for i, n in enumerate(members) if i not in dropped]
        kept += members
    return kept


def grow_dialogue_trees(engine: MultiTurnEngine, rows: Sequence[Mapping[str, Any]],
                        make_env: Callable[[], DialogueEnvironment], *, branching: int, width: int, max_turns: int,
                        quality: Callable[[DialogueNode], bool], temperature: float = 1.0, top_p: float = 1.0,
                        ) -> tuple[Rollout, list[DialogueNode]]:
    """Dialogue trees per row (see the module docstring); returns the leaves as a rollout grouped by goal (with
    ``extras`` ``tree_depth``, ``format_valid``, ``target_queries``) and the leaf nodes in the same order."""
    rows = list(rows)
    envs = [make_env() for _ in range(len(rows) * branching)]
    first, trajectories = engine.start(rows, envs, num_samples=branching, temperature=temperature, top_p=top_p)
    roots = [DialogueNode(t, env, root=i, group=i // branching, choices=[i % branching])
             for i, (t, env) in enumerate(zip(trajectories, envs))]
    queries = [0]

    def step(nodes: list[DialogueNode]) -> list[DialogueNode]:
        """The target answers every (well-formed) child; pruning first, so a pruned turn costs no query."""
        nodes = prune_nodes(nodes, width=width, quality=quality)
        waiting = [n for n in nodes if n.trajectory.awaiting_environment]
        engine._step_environments([n.trajectory for n in waiting], [n.env for n in waiting])
        queries[0] += len(waiting)
        for node in nodes:  # the last turn was answered: the dialogue ends there
            if node.trajectory.turns >= max_turns:
                node.trajectory.done = True
        return nodes

    def expand(parents: list[tuple[DialogueNode, int]]) -> list[DialogueNode]:
        children = [parent.fork(child) for parent, child in parents]
        prompts = select_rows(first.prompt_inputs, [c.root for c in children])
        engine._next_turn([c.trajectory for c in children], list(range(len(children))), prompts,
                          temperature=temperature, top_p=top_p, do_sample=True)
        return step(children)

    leaves = grow_frontier(step(roots), group_of=lambda n: n.group, expand=expand, max_depth=max_turns,
                           fork=lambda active, finished, finished_now: [branching] * len(active))
    leaves.sort(key=lambda n: (n.group, n.choices))
    leaf_roots = first.select([n.root for n in leaves])
    rollout = engine._rollout(leaf_roots.rows, leaf_roots.group_ids, leaf_roots.prompt_inputs,
                              [n.trajectory for n in leaves])
    rows_out = [{**first.rows[n.root], "dialogue": n.env.dialogue} for n in leaves]
    extras = dict(rollout.extras)
    extras["tree_depth"] = torch.tensor([n.trajectory.turns for n in leaves], dtype=torch.long)
    extras["format_valid"] = torch.tensor([n.valid for n in leaves], dtype=torch.bool)
    extras["target_queries"] = torch.full((len(leaves),), float(queries[0]) / max(len(leaves), 1))
    engine.last_transcripts = [n.trajectory.transcript for n in leaves]
    return dataclasses.replace(rollout, rows=rows_out, extras=extras), leaves


def format_token_mask(completion_ids: Tensor, tag_ids: Sequence[Sequence[int]]) -> Tensor:
    """(N, T) bool: the positions of every occurrence of a tag's token sequence in ``completion_ids``."""
    mask = torch.zeros_like(completion_ids, dtype=torch.bool)
    width = completion_ids.shape[1]
    for tag in tag_ids:
        length = len(tag)
        if length == 0 or length > width:
            continue
        pattern = torch.tensor(list(tag), dtype=completion_ids.dtype, device=completion_ids.device)
        windows = completion_ids.unfold(1, length, 1)  # (N, T - length + 1, length)
        starts = (windows == pattern).all(-1)
        for offset in range(length):
            mask[:, offset:offset + starts.shape[1]] |= starts
    return mask


def adaptive_format_mask(completion_mask: Tensor, format_positions: Tensor, advantages: Tensor) -> Tensor:
    """The loss mask of adaptive masking: the completion mask without the format tokens of the leaves whose
    advantage is negative (their other tokens, and every token of the other leaves, stay)."""
    negative = (advantages < 0).to(completion_mask.device).unsqueeze(-1)
    return completion_mask * ~(format_positions.to(completion_mask.device) & negative)


@dataclass(frozen=True)
class DialTreeConfig:
    """Tree, pruning, target and judge (``model.init_args.dialtree`` in YAML).

    Attributes:
        branching: candidate turns per active node (and first turns per goal); >= 2, so every goal has two leaves.
        width: active nodes per goal kept after pruning at each depth.
        max_turns: policy turns per dialogue.
        max_total_tokens: completion tokens (policy and target) per dialogue.
        require_think: a turn without ``</think>`` followed by a message is malformed (pruned).
        format_tags: the format strings whose tokens adaptive masking protects.
        adaptive_masking: drop format tokens from the loss of negative-advantage leaves.
        target: ``module:fn`` / ``file.py:fn`` factory returning ``target(said, row) -> reply``.
        judge: ``module:fn`` / ``file.py:fn``: ``judge(dialogue, row) -> score`` (the outcome reward).
        relevance: ``module:fn`` / ``file.py:fn``: ``relevance(message, row) -> bool`` (off-goal turns are pruned).
    """

    branching: int = 2
    width: int = 4
    max_turns: int = 3
    max_total_tokens: int = 256
    require_think: bool = True
    format_tags: list[str] = field(default_factory=lambda: ["<think>", "</think>"])
    adaptive_masking: bool = True
    target: str = "mmpo.algos.dialtree:LockTarget"
    judge: str = "mmpo.algos.dialtree:code_revealed"
    relevance: str = "mmpo.algos.dialtree:any_message"

    def __post_init__(self) -> None:
        for name in ("branching", "width", "max_turns", "max_total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dialtree.{name} must be an integer >= 1, got {value!r}")
        if self.branching < 2:
            raise ValueError(f"dialtree.branching must be >= 2 (GRPO needs two leaves per goal), got {self.branching}")

    def load(self) -> tuple[Callable, Callable, Callable]:
        """(target, judge, relevance), loaded and checked."""
        target = load_function(parse_spec(self.target, "dialtree target"))()
        judge = load_function(parse_spec(self.judge, "dialtree judge"))
        relevance = load_function(parse_spec(self.relevance, "dialtree relevance"))
        if not callable(target):
            raise ValueError(f"dialtree.target {self.target!r} must return a callable target(said, row) -> reply")
        return target, judge, relevance


class DialTreeModule(GRPOModule):
    """DIALTREE-RPO (see the module docstring). Reward: the judge's score of each leaf's dialogue plus the
    ``rewards.weights`` functions on its last policy message.

    Logged per step: ``dialtree/success_rate`` (judge > 0), ``dialtree/format_valid_rate`` (leaves not pruned as
    malformed or off-goal), ``dialtree/leaves_per_goal``, ``dialtree/target_queries`` (per goal),
    ``dialtree/masked_format_tokens``.
    """

    config_groups = (*GRPOModule.config_groups, "dialtree")

    def __init__(self, model_path: str, dialtree: DialTreeConfig = DialTreeConfig(), **kwargs: Any) -> None:
        self.dialtree = as_config(dialtree, DialTreeConfig())
        super().__init__(model_path, **kwargs)
        self.target, self.judge, self.relevance = self.dialtree.load()
        self.multiturn = MultiTurnEngine(self.engine, max_turns=self.dialtree.max_turns,
                                         max_total_tokens=self.dialtree.max_total_tokens,
                                         max_tokens_per_turn=self.sampling.max_new_tokens)
        tokenizer = self.processor.tokenizer
        self.format_tag_ids = [list(tokenizer(tag, add_special_tokens=False)["input_ids"])
                               for tag in self.dialtree.format_tags]

    def _validate_settings(self) -> None:
        super()._validate_settings()
        require(self.rollout_engine.name == "hf", "dialtree: tree rollouts run on rollout_engine: hf")
        require(self.optim.minibatch_size is None and self.optim.micro_batch_size in (None, 1),
                "dialtree: optim.minibatch_size must be null and micro_batch_size null or 1 (the number of leaves "
                "varies per step)")
        require(not self.advantage.dynamic_sampling_retries, "dialtree: advantage.dynamic_sampling_retries is not "
                "supported (a resample would not be a tree)")
        self.dialtree.load()

    def _environment(self) -> DialogueEnvironment:
        return DialogueEnvironment(self.target, self.judge)

    def _quality(self, node: DialogueNode) -> bool:
        return turn_quality(node.trajectory.last_message, node.env.row, require_think=self.dialtree.require_think,
                            relevance=self.relevance)

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """The leaves of one dialogue tree per row, grouped by goal."""
        rollout, _ = grow_dialogue_trees(self.multiturn, rows, self._environment, branching=self.dialtree.branching,
                                         width=self.dialtree.width, max_turns=self.dialtree.max_turns,
                                         quality=self._quality, temperature=self.sampling.temperature,
                                         top_p=self.sampling.top_p)
        return rollout

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The judge on each leaf's dialogue (+ the reward functions on its last policy message)."""
        total, metrics = super().compute_rewards(rollout)
        judged = torch.tensor([float(self.judge(row["dialogue"], row)) for row in rollout.rows], dtype=total.dtype)
        metrics["rewards/judge/mean"] = float(judged.mean())
        metrics["dialtree/success_rate"] = float((judged > 0).float().mean())
        return total + judged.to(total.device), metrics

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout,
                           ) -> tuple[Tensor, dict[str, float]]:
        """GRPO's advantage over the leaves of each goal; with ``adaptive_masking`` the loss mask leaves out the
        format tokens of the negative-advantage leaves."""
        advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
        require(advantages.ndim == 1, f"dialtree: advantage.name {self.advantage.name!r} gives per-token advantages; "
                "adaptive masking needs one advantage per leaf")
        if self.dialtree.adaptive_masking:
            positions = format_token_mask(rollout.completion_ids, self.format_tag_ids) & (rollout.completion_mask > 0)
            mask = adaptive_format_mask(rollout.completion_mask, positions, advantages.cpu())
            rollout.extras["loss_mask"] = mask
            metrics["dialtree/masked_format_tokens"] = float((rollout.completion_mask - mask).sum())
        return advantages, metrics

    def end_step(self, state: StepState) -> None:
        rollout = state.rollout
        if rollout is not None and "format_valid" in rollout.extras:
            goals = max(int(rollout.group_ids.unique().numel()), 1)
            state.metrics["dialtree/format_valid_rate"] = float(rollout.extras["format_valid"].float().mean())
            state.metrics["dialtree/leaves_per_goal"] = len(rollout) / goals
            state.metrics["dialtree/target_queries"] = float(rollout.extras["target_queries"][0]) * len(rollout) / goals

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """One greedy dialogue per held-out goal: ``val/success`` (judge > 0) and ``val/format_valid``."""
        rows = list(batch)
        envs = [self._environment() for _ in rows]
        self.multiturn.generate(rows, envs, num_samples=1, do_sample=False)
        success = [float(self.judge(env.dialogue, row) > 0) for env, row in zip(envs, rows)]
        valid = [float(dialogue_format_valid(transcript, row, require_think=self.dialtree.require_think,
                                             relevance=self.relevance))
                 for transcript, row in zip(self.multiturn.last_transcripts, rows)]
        self.log_dict({"val/success": sum(success) / len(rows), "val/format_valid": sum(valid) / len(rows)},
                      batch_size=len(rows), sync_dist=True, prog_bar=True)


class FlatDialogueModule(DialTreeModule):
    """Flat multi-turn GRPO on dialogues, DIALTREE-RPO's baseline: ``sampling.num_generations`` independent
    dialogues per goal against the same target and judge, each up to ``dialtree.max_turns`` policy turns (no tree:
    ``dialtree.branching`` and ``width`` are unused, nothing is pruned, every turn is sent to the target). Reward,
    GRPO over the dialogues of a goal, adaptive masking (per ``dialtree.adaptive_masking``) and the logged
    ``dialtree/*`` metrics are DIALTREE-RPO's; a dialogue is format-valid when every turn passes
    :func:`turn_quality`, and ``dialtree/target_queries`` counts the target's answers per goal, the budget two
    runs are compared at."""

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        rows = list(rows)
        envs = [self._environment() for _ in range(len(rows) * self.sampling.num_generations)]
        rollout = self.multiturn.generate(rows, envs, num_samples=self.sampling.num_generations,
                                          temperature=self.sampling.temperature, top_p=self.sampling.top_p)
        valid = [dialogue_format_valid(transcript, row, require_think=self.dialtree.require_think,
                                       relevance=self.relevance)
                 for transcript, row in zip(self.multiturn.last_transcripts, rollout.rows)]
        extras = dict(rollout.extras)
        extras["tree_depth"] = torch.tensor([len(env.said) for env in envs], dtype=torch.long)
        extras["format_valid"] = torch.tensor(valid, dtype=torch.bool)
        extras["target_queries"] = torch.full((len(envs),), sum(env.queries for env in envs) / max(len(envs), 1))
        rows_out = [{**row, "dialogue": env.dialogue} for row, env in zip(rollout.rows, envs)]
        return dataclasses.replace(rollout, rows=rows_out, extras=extras)


__all__ = ["DialTreeConfig", "DialTreeModule", "DialogueEnvironment", "DialogueNode", "FlatDialogueModule",
           "LockTarget", "ModelTarget", "adaptive_format_mask", "any_message", "code_revealed",
           "dialogue_format_valid", "format_token_mask", "grow_dialogue_trees", "prune_nodes", "split_turn",
           "turn_quality"]
