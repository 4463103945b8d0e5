"""TAPO: Thought-Augmented Policy Optimization (arXiv 2505.15692), GRPO with thought templates in part of each group.

1. Library (offline, ``mmpo tapo-library``): on seed problems, a tree search over sequences of high-level
   reasoning actions (the HiAR-ICL action set, arXiv 2411.18478: system analysis, one-step thought, chain of
   thought, divide and conquer, self-reflection and refinement) scores each sequence by the policy's mean reward
   with the rendered template in its prompt; the best sequence of each seed problem is kept, indexed by the
   problem's condition complexity (:func:`condition_complexity`).
2. Training (:class:`TAPOModule`): for each prompt the ``templates_per_problem`` templates nearest in complexity
   are retrieved (:func:`retrieve`); ``guided_per_group`` of the G rollouts are sampled with a template before the
   problem, the rest without; rewards and the group-relative advantage are computed over the whole mixed group,
   and the GRPO loss trains every completion under the prompt it was sampled from.

No official code was found. UNVERIFIED and chosen here (docs/prompt_space.md): the search is a beam search over
the action tree (the paper: MCTS); complexity = the number of numbers stated in the problem (the paper:
"problem condition complexity", the count of known conditions); the mix (``guided_per_group`` 2 of G);
guided completions keep the template in their training prompt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.vlm.rollout import Rollout, concat_rollouts

#: HiAR-ICL's reasoning actions (names from arXiv 2411.18478; the one-line instructions are written here)
REASONING_ACTIONS: dict[str, str] = {
    "SA": "System analysis: list the known conditions and state exactly what is asked.",
    "OST": "One-step thought: take the single next step that gets closer to the answer.",
    "CoT": "Chain of thought: reason step by step until the answer.",
    "DC": "Divide and conquer: split the problem into sub-problems, solve each, combine them.",
    "SRR": "Self-reflection and refinement: check the result against the conditions and fix any error.",
}
GUIDED_KEY = "tapo_guided"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def condition_complexity(problem: str) -> int:
    """The number of numbers stated in the problem text (this module's measure of its known conditions)."""
    return len(_NUMBER.findall(problem))


def render_template(actions: Sequence[str]) -> str:
    """A template as prompt text: ``Follow this thought template:`` then one numbered line per action."""
    unknown = [a for a in actions if a not in REASONING_ACTIONS]
    if unknown or not actions:
        raise ValueError(f"a template is a non-empty sequence of {sorted(REASONING_ACTIONS)}, got {list(actions)}")
    return "Follow this thought template:\n" + "\n".join(
        f"{i + 1}. {REASONING_ACTIONS[a]}" for i, a in enumerate(actions))


def children(actions: tuple[str, ...], action_set: Sequence[str]) -> list[tuple[str, ...]]:
    """The tree's children of a node: one more action, never the same action twice in a row."""
    return [actions + (a,) for a in action_set if not actions or actions[-1] != a]


def search_templates(score: Callable[[tuple[str, ...]], float], *, action_set: Sequence[str] = tuple(REASONING_ACTIONS),
                     max_depth: int = 3, beam: int = 2) -> list[tuple[tuple[str, ...], float]]:
    """Beam search over the action tree: every child of the ``beam`` best nodes of a depth is scored, up to
    ``max_depth`` actions. Returns every scored node as (actions, value), best first (ties: shorter, then
    lexicographic)."""
    require(max_depth >= 1 and beam >= 1, f"max_depth and beam must be >= 1, got {max_depth}, {beam}")
    scored: dict[tuple[str, ...], float] = {}
    frontier: list[tuple[str, ...]] = [()]
    for _ in range(max_depth):
        level = [child for node in frontier for child in children(node, action_set)]
        for node in level:
            scored[node] = float(score(node))
        frontier = sorted(level, key=lambda n: (-scored[n], len(n), n))[:beam]
    return sorted(scored.items(), key=lambda item: (-item[1], len(item[0]), item[0]))


def build_library(rows: Sequence[Mapping[str, Any]], score: Callable[[Mapping[str, Any], tuple[str, ...]], float], *,
                  max_depth: int = 3, beam: int = 2, action_set: Sequence[str] = tuple(REASONING_ACTIONS)) -> dict:
    """The template library of ``rows``: per seed problem the best action sequence of :func:`search_templates`,
    merged by (complexity, actions) with the mean value and the count of problems that chose it."""
    merged: dict[tuple[int, tuple[str, ...]], list[float]] = {}
    for row in rows:
        (best, value), *_ = search_templates(lambda node: score(row, node), action_set=action_set,
                                             max_depth=max_depth, beam=beam)
        merged.setdefault((condition_complexity(row["problem"]), best), []).append(value)
    templates = [{"actions": list(actions), "complexity": complexity, "value": sum(v) / len(v), "count": len(v)}
                 for (complexity, actions), v in sorted(merged.items())]
    return {"format": "mmpo-tapo-library", "version": 1, "max_depth": max_depth, "beam": beam,
            "templates": templates}


def load_library(path: str | Path) -> dict:
    library = json.loads(Path(path).read_text())
    if library.get("format") != "mmpo-tapo-library" or not library.get("templates"):
        raise ValueError(f"{path} is not a TAPO template library with templates (build one with mmpo tapo-library)")
    return library


def retrieve(library: Mapping[str, Any], problem: str, k: int = 1) -> list[list[str]]:
    """The ``k`` templates nearest the problem's complexity: by |complexity difference|, then higher value,
    then more seed problems, then the action names; distinct action sequences only."""
    target = condition_complexity(problem)
    ranked = sorted(library["templates"], key=lambda t: (abs(t["complexity"] - target), -t["value"], -t["count"],
                                                          t["actions"]))
    chosen: list[list[str]] = []
    for template in ranked:
        if template["actions"] not in chosen:
            chosen.append(template["actions"])
        if len(chosen) == k:
            break
    return chosen


def guided_problem(problem: str, actions: Sequence[str]) -> str:
    """The guided prompt: the rendered template, a blank line, the problem."""
    return render_template(actions) + "\n\n" + problem


class TAPOModule(GRPOModule):
    """GRPO whose groups mix template-guided and unguided rollouts.

    Args:
        model_path: saved HF model directory.
        library: the template library JSON (``mmpo tapo-library``).
        guided_per_group: rollouts of each group sampled with a template (1 <= it <= G; the rest unguided).
        templates_per_problem: templates retrieved per problem; guided rollout j uses template j mod k.
        **kwargs: every :class:`GRPOModule` setting.
    """

    def __init__(self, model_path: str, *, library: str, guided_per_group: int = 2, templates_per_problem: int = 1,
                 **kwargs: Any) -> None:
        self.library = load_library(library)
        super().__init__(model_path, **kwargs)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h, g = self.hparams, self.sampling.num_generations
        require(1 <= h.guided_per_group <= g, f"guided_per_group must be in [1, G={g}], got {h.guided_per_group}")
        require(h.templates_per_problem >= 1, f"templates_per_problem must be >= 1, got {h.templates_per_problem}")

    def guided_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``guided_per_group`` copies of each row (row-major), copy j with retrieved template j mod k."""
        h = self.hparams
        out = []
        for row in rows:
            templates = retrieve(self.library, row["problem"], h.templates_per_problem)
            out += [{**row, "problem": guided_problem(row["problem"], templates[j % len(templates)]),
                     "tapo_template": list(templates[j % len(templates)])} for j in range(h.guided_per_group)]
        return out

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G completions per row: ``guided_per_group`` guided first, then the unguided ones; group id = row."""
        g, m = self.sampling.num_generations, self.hparams.guided_per_group
        common = dict(max_new_tokens=self.sampling.max_new_tokens, temperature=self.sampling.temperature,
                      top_p=self.sampling.top_p, do_sample=True, **self._engine_log_prob_request())
        guided = self.engine.generate(self.guided_rows(rows), num_samples=1, **common)
        guided.extras[GUIDED_KEY] = torch.ones(len(guided), dtype=torch.bool)
        parts = [guided]
        if g > m:
            plain = self.engine.generate(list(rows), num_samples=g - m, **common)
            plain.extras[GUIDED_KEY] = torch.zeros(len(plain), dtype=torch.bool)
            parts.append(plain)
        merged = concat_rollouts(parts) if len(parts) > 1 else parts[0]
        n = len(rows)
        # guided sample j of row r sits at r * m + j; unguided sample s of row r at n * m + r * (g - m) + s
        order = [pos for r in range(n) for pos in
                 [r * m + j for j in range(m)] + [n * m + r * (g - m) + s for s in range(g - m)]]
        merged = merged.select(order)
        merged.group_ids = torch.arange(n).repeat_interleave(g)
        return merged

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        rewards, metrics = super().compute_rewards(rollout)
        metrics.update(tapo_metrics(rewards, rollout.group_ids, rollout.extras[GUIDED_KEY]))
        return rewards, metrics


def tapo_metrics(rewards: Tensor, group_ids: Tensor, guided: Tensor) -> dict[str, float]:
    """Mean reward of guided and unguided rollouts, and the share of groups whose unguided rollouts all score
    <= 0 (the all-wrong groups plain GRPO would have had) and of all-wrong groups after mixing."""
    out = {"tapo/guided_reward_mean": float(rewards[guided].mean()) if guided.any() else float("nan"),
           "tapo/unguided_reward_mean": float(rewards[~guided].mean()) if (~guided).any() else float("nan")}
    groups = group_ids.unique()
    all_wrong = [bool((rewards[group_ids == gid] <= 0).all()) for gid in groups]
    out["tapo/all_wrong_group_frac"] = sum(all_wrong) / len(groups)
    if (~guided).any():
        plain_wrong = [bool((rewards[(group_ids == gid) & ~guided] <= 0).all()) for gid in groups]
        out["tapo/unguided_all_wrong_group_frac"] = sum(plain_wrong) / len(groups)
    return out
