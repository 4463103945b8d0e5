"""ARPO: Agentic Reinforced Policy Optimization (Dong et al., arXiv 2507.19849): entropy-based adaptive branching
of multi-turn tool-use rollouts, then GRPO.

Official code: ``dongguanting/ARPO``, ``ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/
vllm_rollout_with_tools.py`` (``vLLMRolloutWithTools.generate_sequences``); defaults from
``ARPO/scripts/ARPO_7B_Reasoning_1node.sh``. The rollout, per prompt, with budget ``n`` trajectories
(``sampling.num_generations``):

1. ``initial_rollouts`` global trajectories start from the prompt (the rest of the budget is for branches).
2. Rounds: every active trajectory writes one model turn. The entropy of that segment is measured on its first
   ``entropy_window`` (20) tokens: the top-``entropy_top_k`` (10) log-probs of each position (and the sampled
   token's, when not among them: what vLLM's ``logprobs=10`` returns) are pooled into one list, and
   H = -sum p log p over it / ln |V| (:func:`pooled_entropy`). A trajectory's first segment sets its initial
   entropy H_init; each later segment (written right after a tool answer) is H_now.
3. The tools answer (the environment step); then each prompt whose trajectories are still active and whose
   count is below ``n`` branches: each active trajectory gets up to ``beam_size - 1`` tries, each forking a full
   copy of it (tokens, tool answers, environment) with probability clip(alpha + beta * (H_now - H_init), 0, 1)
   (alpha ``branch_probability``, beta ``entropy_weight``): the official test
   ``clip(u - beta * dH, 0, 1) <= alpha`` with u ~ U[0, 1) (:func:`branch_decisions`).
4. A prompt with no active trajectory and fewer than ``n`` gets one new global trajectory per round (the unused
   branch budget becomes extra global samples), until it has ``n``.
5. Each prompt keeps its first ``n`` trajectories in creation order (the last one repeated if fewer), as one
   contiguous group, and GRPO trains on them unchanged.

Advantage attribution: ``soft`` (official, the default): plain GRPO over the group, where a prefix shared by a
trajectory and its branches appears in each of them and so receives their advantages together; ``hard`` (the
paper's alternative, section 3.3): every token of a shared prefix gets the mean advantage of the trajectories that
share it (:func:`shared_prefix_advantages`).

Validation and greedy decoding branch nothing (official: ``n = 1``, ``beam_size = 1`` when validating).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmpo.algos.agent import AgentGRPOModule
from mmpo.training.config import as_config
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.vlm.multiturn import MultiTurnEngine, _Trajectory
from mmpo.vlm.processing import encode_prompts, select_rows
from mmpo.vlm.rollout import Rollout, _SampledLogProbRecorder


def pooled_entropy(log_probs: Sequence[float]) -> float:
    """-sum exp(l) * l over one pooled list of log-probs (0 for an empty list); the official ``_calc_entropy``.
    Example: [ln 0.5, ln 0.25] -> 0.5 ln 2 + 0.25 ln 4 = ln 2."""
    return -sum(math.exp(value) * value for value in log_probs if math.isfinite(value))


def top_logprob_entropy(top: Sequence[Mapping[int, float]], *, window: int, vocab_size: int) -> float:
    """A segment's entropy from its positions' top log-probs (``top[t]``: ``{token: log-prob}``, vLLM's ``logprobs=k``
    dictionary: the k most likely tokens and the sampled one): :func:`pooled_entropy` of every value of the first
    ``window`` positions, pooled into one list, over ln ``vocab_size`` (0 for no position); the official entropy
    block of ``generate_sequences``. Example: one position {a: ln 0.5, b: ln 0.25}, |V| = 4 -> ln 2 / ln 4 = 0.5."""
    pooled = [value for step in top[:window] for value in step.values()]
    return pooled_entropy(pooled) / math.log(vocab_size) if pooled else 0.0


def branch_probability(entropy_delta: float, *, alpha: float, beta: float) -> float:
    """P(fork) = clip(alpha + beta * dH, 0, 1): what the official test ``clip(u - beta dH, 0, 1) <= alpha`` draws."""
    return min(1.0, max(0.0, alpha + beta * entropy_delta))


def branch_decisions(active_by_prompt: Mapping[int, Sequence[int]], counts: list[int], *, num_samples: int,
                     beam_size: int, alpha: float, beta: float, entropy_now: Mapping[int, float],
                     entropy_init: Mapping[int, float], uniform: Callable[[], float]) -> list[tuple[int, int]]:
    """The forks of one round, in order, as ``(prompt, source trajectory)``; ``counts[prompt]`` (trajectories
    per prompt) grows by one per fork.

    For each prompt (in ``active_by_prompt`` order) below ``num_samples``, each of its active trajectories gets up
    to ``min(beam_size - 1, remaining)`` tries; a try draws u = ``uniform()`` and forks iff
    clip(u - beta * (H_now - H_init), 0, 1) <= alpha (entropies default to 0). Stops when the prompt's budget is
    used."""
    forks: list[tuple[int, int]] = []
    for prompt, sources in active_by_prompt.items():
        remaining = num_samples - counts[prompt]
        if remaining <= 0:
            continue
        created = 0
        for source in sources:
            tries = min(beam_size - 1, remaining - created)
            if tries <= 0:
                break
            for _ in range(tries):
                delta = entropy_now.get(source, 0.0) - entropy_init.get(source, 0.0)
                if min(1.0, max(0.0, uniform() - beta * delta)) > alpha:
                    continue
                forks.append((prompt, source))
                counts[prompt] += 1
                created += 1
            if created >= remaining:
                break
    return forks


def shared_prefix_advantages(advantages: Tensor, completion_ids: Tensor, attention: Tensor,
                             group_ids: Tensor) -> Tensor:
    """(N, T) ARPO's hard advantage attribution: token t of trajectory i gets the mean advantage of the trajectories
    of its group whose first t + 1 tokens equal i's (the trajectories that share that prefix: i and its branches,
    or the trajectory it branched from). Tokens no other trajectory shares keep A_i.

    Example: A = [1, 0, -1] in one group, trajectory 1 a branch of 0 sharing their first 2 tokens, 2 independent:
    row 0 -> [0.5, 0.5, 1, ...], row 1 -> [0.5, 0.5, 0, ...], row 2 -> [-1, ...]."""
    n, width = completion_ids.shape
    out = advantages.reshape(n, 1).expand(n, width).clone().to(torch.float32)
    lengths = attention.sum(-1).tolist()
    for group in group_ids.unique().tolist():
        members = torch.nonzero(group_ids == group).flatten().tolist()
        for i in members:
            total = torch.zeros(width)
            count = torch.zeros(width)
            for j in members:
                span = int(min(lengths[i], lengths[j]))
                same = (completion_ids[i, :span] == completion_ids[j, :span]).long()
                shared = int(same.cumprod(0).sum())  # the common prefix length
                total[:shared] += float(advantages[j])
                count[:shared] += 1
            covered = count > 0
            out[i, covered] = total[covered] / count[covered]
    return out


@dataclass(frozen=True)
class ARPOConfig:
    """ARPO's rollout (``model.init_args.arpo``); defaults from ``ARPO/scripts/ARPO_7B_Reasoning_1node.sh`` and
    ``vllm_rollout_with_tools.py`` (dongguanting/ARPO).

    Attributes:
        initial_rollouts: global trajectories per prompt at the start (script: 8 of ``rollout.n`` 16); capped at
            ``sampling.num_generations``.
        beam_size: a branching try makes up to ``beam_size - 1`` forks of an active trajectory per round (script: 2).
        branch_probability: alpha, the fork probability at no entropy change (script: 0.5).
        entropy_weight: beta, the weight of the entropy change (script: 0.2; code fallback 0.5).
        entropy_window: tokens of a segment whose entropy is measured (code: 20).
        entropy_top_k: log-probs per position pooled into the entropy (code: vLLM ``logprobs=10``).
        initial_entropy: ``per_rollout``: a trajectory's initial entropy is its own first segment's, within this
            rollout (the paper); ``persistent``: as the official code, a dict keyed by trajectory index that is
            never cleared, so later steps compare with the entropy stored when that index was first seen.
        attribution: ``soft`` (official: plain GRPO over the group) or ``hard`` (shared-prefix tokens get the mean
            advantage of the trajectories sharing them).
        seed: seeds the branching draws (a ``random.Random``; each step continues its stream).
    """

    initial_rollouts: int = 8
    beam_size: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    entropy_window: int = 20
    entropy_top_k: int = 10
    initial_entropy: str = "per_rollout"
    attribution: str = "soft"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("initial_rollouts", "beam_size", "entropy_window", "entropy_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"arpo.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.branch_probability <= 1.0:
            raise ValueError(f"arpo.branch_probability must be in [0, 1], got {self.branch_probability!r}")
        if self.initial_entropy not in ("per_rollout", "persistent"):
            raise ValueError(f"arpo.initial_entropy must be per_rollout or persistent, got {self.initial_entropy!r}")
        if self.attribution not in ("soft", "hard"):
            raise ValueError(f"arpo.attribution must be soft or hard, got {self.attribution!r}")


class _EntropyProbe(_SampledLogProbRecorder):
    """The log-prob recorder that also keeps the top-k log-probs of the first ``window`` steps (the distribution
    the sampler draws from), for :meth:`segment_entropies`."""

    def __init__(self, top_k: int, window: int) -> None:
        super().__init__()
        self.top_k, self.window = top_k, window
        self.top: list[tuple[Tensor, Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = super().__call__(input_ids, scores)
        if len(self.top) < self.window:
            values, indices = self._previous.topk(min(self.top_k, self._previous.shape[-1]), dim=-1)
            self.top.append((values.cpu(), indices.cpu()))
        return out

    def segment_entropies(self, drawn: Sequence[Sequence[int]], log_probs: Sequence[Sequence[float]],
                          vocab_size: int) -> list[float]:
        """Per row: :func:`top_logprob_entropy` of its first ``window`` positions' top-k log-probs (and the sampled
        token's when not among them), the dictionaries vLLM's ``logprobs=k`` returns."""
        out = []
        for row, (tokens, sampled) in enumerate(zip(drawn, log_probs)):
            top = []
            for step in range(min(self.window, len(tokens), len(self.top))):
                values, indices = self.top[step]
                entry = dict(zip(indices[row].tolist(), values[row].tolist()))
                entry.setdefault(tokens[step], float(sampled[step]))
                top.append(entry)
            out.append(top_logprob_entropy(top, window=self.window, vocab_size=vocab_size))
        return out


class ARPOEngine(MultiTurnEngine):
    """Multi-turn rollouts with ARPO's entropy-based branching (the module docstring); greedy decoding and one
    sample per prompt go to :class:`MultiTurnEngine` unchanged.

    On the HF engine each round is one turn-synchronous HF turn (re-prefilled, no kept cache) whose entropy probe reads
    the distribution the sampler draws from; on the vLLM engine each round is one vLLM call (one request per active
    trajectory, on vLLM's prefix cache, :meth:`MultiTurnEngine._vllm_turn`) with ``logprobs=entropy_top_k``, whose
    returned top log-probs give the entropy, as in the official code. ``last_entropies``: the segment entropies of
    each trajectory of the last rollout, one per model turn (a branch's start with its source's)."""

    def __init__(self, engine: Any, settings: ARPOConfig, **limits: int) -> None:
        super().__init__(engine, **limits)
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.persistent_initial_entropy: dict[int, float] = {}
        self.last_stats: dict[str, float] = {}
        self.last_entropies: list[list[float]] = []

    def state_dict(self) -> dict[str, Any]:
        """The branching draws' RNG state and the persistent initial entropies (checkpointed with the run)."""
        return {"rng": self.rng.getstate(), "initial_entropy": dict(self.persistent_initial_entropy)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self.persistent_initial_entropy = {int(k): float(v) for k, v in state["initial_entropy"].items()}

    def generate(self, rows: Sequence[Mapping[str, Any]], envs: Sequence[Any], *, num_samples: int,
                 temperature: float = 1.0, top_p: float = 1.0, do_sample: bool = True) -> Rollout:
        rows = list(rows)
        if not do_sample or num_samples == 1:
            return super().generate(rows, envs, num_samples=num_samples, temperature=temperature, top_p=top_p,
                                    do_sample=do_sample)
        if len(envs) != len(rows) * num_samples:
            raise ValueError(f"{len(envs)} environments for {len(rows)} rows x {num_samples} samples")
        s, n = self.settings, num_samples
        self.last_prefill_tokens = 0
        trajectories: list[_Trajectory] = []
        owners: list[int] = []
        environments: list[Any] = []
        counts = [0] * len(rows)
        forked = []
        entropies: list[list[float]] = []
        first_messages = [envs[p * n].reset(row) for p, row in enumerate(rows)]
        prompt_rows = self.tool_prompt_rows(rows, first_messages, [envs[p * n].tools for p in range(len(rows))])
        on_vllm = getattr(self.engine, "continue_token_ids", None) is not None
        if on_vllm:
            prompts, starts, prompt_images = self.vllm_prompts(prompt_rows)
        else:
            prompts = encode_prompts(self.engine.processor, prompt_rows, system_prompt=self.engine.system_prompt,
                                     max_prompt_length=self.engine.max_prompt_length)

        def start(prompt: int) -> int:
            env = envs[prompt * n + counts[prompt]]
            message = env.reset(rows[prompt]) if counts[prompt] else first_messages[prompt]
            trajectory = _Trajectory()
            trajectory.transcript.append({"role": "user", "content": message})
            trajectories.append(trajectory)
            owners.append(prompt)
            environments.append(env)
            forked.append(False)
            entropies.append([])
            counts[prompt] += 1
            return len(trajectories) - 1

        active = [start(p) for p in range(len(rows)) for _ in range(min(s.initial_rollouts, n))]
        initial = self.persistent_initial_entropy if s.initial_entropy == "persistent" else {}
        vocab_size = len(self.engine.processor.tokenizer.get_vocab())
        forks = topups = 0
        deltas: list[float] = []
        while active:
            if on_vllm:
                samples = self._vllm_turn(trajectories, active, [starts[owners[i]] for i in active],
                                          None if prompt_images is None else [prompt_images[owners[i]] for i in active],
                                          temperature=temperature, top_p=top_p, do_sample=True,
                                          top_logprobs=s.entropy_top_k)
                current = {i: top_logprob_entropy(sample.top, window=s.entropy_window, vocab_size=vocab_size)
                           for i, sample in zip(active, samples)}
            else:
                probe = _EntropyProbe(s.entropy_top_k, s.entropy_window)
                drawn = self._next_turn(trajectories, active, prompts, prompt_rows=owners, recorder=probe,
                                        temperature=temperature, top_p=top_p, do_sample=True)
                sampled = [trajectories[i].log_probs[len(trajectories[i].log_probs) - len(d):]
                           for i, d in zip(active, drawn)]
                current = dict(zip(active, probe.segment_entropies(drawn, sampled, vocab_size)))
            for i, value in current.items():
                entropies[i].append(value)
                initial.setdefault(i, value)
            self._step_environments(trajectories, environments)
            still = [i for i in active if not trajectories[i].done]
            by_prompt: dict[int, list[int]] = {}
            for i in still:
                by_prompt.setdefault(owners[i], []).append(i)
            deltas += [current[i] - initial.get(i, 0.0) for i in still]
            new: list[int] = []
            for prompt, source in branch_decisions(by_prompt, counts, num_samples=n, beam_size=s.beam_size,
                                                   alpha=s.branch_probability, beta=s.entropy_weight,
                                                   entropy_now=current, entropy_init=initial, uniform=self.rng.random):
                trajectories.append(_clone(trajectories[source]))
                owners.append(prompt)
                environments.append(_fork_environment(environments[source]))
                forked.append(True)
                entropies.append(list(entropies[source]))
                new.append(len(trajectories) - 1)
                forks += 1
            for prompt in range(len(rows)):  # one new global trajectory per round for a prompt with none active
                if prompt not in by_prompt and counts[prompt] < n:
                    new.append(start(prompt))
                    topups += 1
            active = still + new
        chosen: list[int] = []
        for prompt in range(len(rows)):
            mine = [i for i, owner in enumerate(owners) if owner == prompt][:n]
            chosen += mine + [mine[-1]] * (n - len(mine))
        self.last_transcripts = [trajectories[i].transcript for i in chosen]
        self.last_entropies = [list(entropies[i]) for i in chosen]
        self.last_stats = {"arpo/forks": float(forks), "arpo/topups": float(topups),
                           "arpo/forked_frac": sum(forked[i] for i in chosen) / len(chosen),
                           "arpo/entropy_delta_mean": sum(deltas) / len(deltas) if deltas else 0.0}
        group_ids = torch.tensor([owners[i] for i in chosen], dtype=torch.long)
        return self._rollout([rows[owners[i]] for i in chosen], group_ids,
                             select_rows(prompts, [owners[i] for i in chosen]), [trajectories[i] for i in chosen])


def _clone(trajectory: _Trajectory) -> _Trajectory:
    return _Trajectory(tokens=list(trajectory.tokens), trained=list(trajectory.trained),
                       log_probs=list(trajectory.log_probs), turns=trajectory.turns, tool_calls=trajectory.tool_calls,
                       env_reward=trajectory.env_reward, last_message=trajectory.last_message, done=trajectory.done,
                       awaiting_environment=trajectory.awaiting_environment,
                       transcript=[dict(m) for m in trajectory.transcript], images=list(trajectory.images),
                       answer_images=list(trajectory.answer_images))


def _fork_environment(env: Any) -> Any:
    """A copy of an environment mid-episode: its ``fork()`` when it has one, else a shallow copy (right for
    :class:`~mmpo.tools.env.ToolEnvironment`, whose episode state is the row's images, never modified)."""
    fork = getattr(env, "fork", None)
    return fork() if callable(fork) else copy.copy(env)


class ARPOModule(CheckpointedState, AgentGRPOModule):
    """GRPO on ARPO rollouts (the module docstring): ``sampling.num_generations`` is the rollout budget ``n``.

    Args:
        arpo: :class:`ARPOConfig`.
        **kwargs: every ``AgentGRPOModule`` setting.

    Logged besides the agent's metrics: ``arpo/forks`` and ``arpo/topups`` (trajectories the step created by
    branching and by topping up), ``arpo/forked_frac`` (share of the trained trajectories that are branches),
    ``arpo/entropy_delta_mean`` (H_now - H_init of the trajectories that reached a branching decision).
    """

    config_groups = (*AgentGRPOModule.config_groups, "arpo")
    checkpointed_state = (("arpo_branching", "multiturn"),)

    def __init__(self, model_path: str, arpo: ARPOConfig = ARPOConfig(), **kwargs: Any) -> None:
        self.arpo = as_config(arpo, ARPOConfig())
        super().__init__(model_path, **kwargs)
        self.multiturn = ARPOEngine(self.engine, self.arpo, max_turns=self.agent.max_turns,
                                    max_total_tokens=self.agent.max_total_tokens,
                                    max_tokens_per_turn=self.sampling.max_new_tokens)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
        if self.arpo.attribution == "hard" and advantages.ndim == 1:
            from mmpo.vlm.rollout import completion_attention_mask

            advantages = shared_prefix_advantages(advantages.cpu(), rollout.completion_ids.cpu(),
                                                  completion_attention_mask(rollout).cpu(),
                                                  group_ids.cpu()).to(advantages.device)
        return advantages, metrics

    def end_step(self, state: StepState) -> None:
        super().end_step(state)
        state.metrics.update(self.multiturn.last_stats)



__all__ = ["ARPOConfig", "ARPOEngine", "ARPOModule", "branch_decisions", "branch_probability", "pooled_entropy",
           "shared_prefix_advantages", "top_logprob_entropy"]
