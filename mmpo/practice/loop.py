"""The Training-Free GRPO loop: epochs x batches of group rollouts from a frozen policy, each batch updating a
versioned experience library that the next prompts include (TencentCloudADP/youtu-agent
``utu/practice/training_free_grpo.py`` ``TrainingFreeGRPO.practice``).

Files in ``output_dir`` (all written atomically):

- ``library/step_00000.json`` ...: the library after each step, ``{"version", "step", "epoch", "batch",
  "experiences"}`` (``version`` = number of steps done); never rewritten;
- ``experiences.json``: the latest of those (what a deployment reads);
- ``state.json``: the commit point of a step, written last: the config, the next step and each step's counts;
  a run stopped at any moment resumes from it and reproduces the uninterrupted run (each step's sampling
  seed is ``seed + step`` and the data order depends only on ``seed`` and the epoch);
- ``system_prompt.txt``: at the end, the system prompt with the library appended (the deployed form);
- ``heldout.json``: held-out accuracy with and without the final library (when ``val_size`` > 0).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

import torch

from mmpo.files import atomic_write_json, atomic_write_text
from mmpo.practice.experience import problem_with_experiences, system_with_experiences
from mmpo.practice.updater import ExperienceUpdater, Group

# configs/practice/math_reasoning.yaml of the official repo
DEFAULT_AGENT_OBJECTIVE = ("input: A math question that could falls into any areas of mathematics\n"
                           "output: A step-by-step reasoning process that leads to the final answer")
DEFAULT_LEARNING_OBJECTIVE = ("Help the agent to improve the solving capability on math questions by extracting "
                              "general and concise guidelines.")


@dataclass
class PracticeConfig:
    """A Training-Free GRPO run (defaults: the official ``PracticeArguments``, utu/config/practice_config.py).

    Args:
        model_path: the frozen policy (a saved HF text LM or VLM).
        output_dir: where the library, snapshots and state go.
        tasks: synthetic tasks (``mmpo.data.synthetic``) giving the practice and held-out problems.
        train_size: practice problems per task. val_size: held-out problems per task (0: no held-out eval).
        epochs, batch_size (problems per step), grpo_n (rollouts per problem), temperature: official defaults 3,
            64, 5, 0.7 (math_reasoning.yaml: 1 epoch, batch 50, 5, 0.7).
        max_new_tokens: rollout length. shuffle: reshuffle the problems each epoch.
        num_experiences_per_query: at most this many experiences per group critique (official default 2,
            math_reasoning.yaml 1).
        given_ground_truth: learn only from partially correct groups, showing answers and rewards.
        extractor: ``"policy"`` (the frozen policy itself), ``"rules"`` (:class:`RuleExtractor`),
            ``{"model_path": ...}`` (another local model) or ``{"base_url": ..., "model": ...}`` (a chat endpoint).
        rewards: reward name -> weight (mmpo.rewards); the official math verifier is accuracy alone.
        system_prompt: the policy's system turn ("default": mmpo.data.SYSTEM_PROMPT; null: none).
        batch_update_retries: tries of the batch merge (official: 3).
    """

    model_path: str
    output_dir: str
    tasks: list[str] = field(default_factory=lambda: ["long_arithmetic"])
    train_size: int = 64
    val_size: int = 0
    epochs: int = 3
    batch_size: int = 64
    grpo_n: int = 5
    temperature: float = 0.7
    max_new_tokens: int = 512
    shuffle: bool = True
    seed: int = 0
    agent_objective: str = DEFAULT_AGENT_OBJECTIVE
    learning_objective: str = DEFAULT_LEARNING_OBJECTIVE
    num_experiences_per_query: int = 2
    given_ground_truth: bool = True
    extractor: Union[str, dict] = "policy"
    rewards: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0})
    system_prompt: Union[str, None] = "default"
    batch_update_retries: int = 3

    def check(self) -> None:
        for name in ("train_size", "epochs", "batch_size", "grpo_n", "max_new_tokens", "num_experiences_per_query",
                     "batch_update_retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {self.val_size}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (rollouts are sampled), got {self.temperature}")
        if not self.tasks:
            raise ValueError("tasks must name at least one synthetic task")


class PracticeRunError(ValueError):
    """An output directory the run may not use as asked (one line for the CLI)."""


def practice_rows(config: PracticeConfig, split: str) -> list[dict[str, Any]]:
    """Practice (``train``) or held-out (``test``) rows, tasks interleaved, deterministic by seed."""
    from mmpo.data import synthetic

    size = config.train_size if split == "train" else config.val_size
    per_task = [synthetic.make_items(task, size, seed=config.seed, split=split) for task in config.tasks]
    return [items[i] for i in range(size) for items in per_task if i < len(items)]


def epoch_order(num_rows: int, epoch: int, *, seed: int, shuffle: bool) -> list[int]:
    """The row order of an epoch: ``random.Random(seed * 1_000_003 + epoch)`` shuffles it (identity without shuffle)."""
    order = list(range(num_rows))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def with_library(row: dict[str, Any], experiences: dict[str, str]) -> dict[str, Any]:
    """A copy of ``row`` whose problem carries the library (the official practice prompt)."""
    return {**row, "problem": problem_with_experiences(row["problem"], experiences)}


class TrainingFreeGRPO:
    """Runs :class:`PracticeConfig`; ``policy`` / ``backend`` may be given (tests), else they are loaded; ``rows``
    replaces the synthetic practice problems (rows with ``problem`` and ``answer``)."""

    def __init__(self, config: PracticeConfig, *, policy: tuple[Any, Any] | None = None, backend: Any = None,
                 rows: list[dict[str, Any]] | None = None) -> None:
        config.check()
        self.config = config
        self.out = Path(config.output_dir)
        self.rows = practice_rows(config, "train") if rows is None else list(rows)  # own rows: config.tasks unused
        if len(self.rows) < config.batch_size:
            raise ValueError(f"{len(self.rows)} practice problems are fewer than batch_size {config.batch_size}")
        self.num_batches = len(self.rows) // config.batch_size  # the remainder is dropped, as in the official loop
        self.total_steps = config.epochs * self.num_batches
        if policy is None:
            from mmpo.vlm.factory import load_vlm

            policy = load_vlm(config.model_path)
        self.model, self.processor = policy
        self.model.requires_grad_(False)  # frozen: nothing here computes a gradient
        if backend is None:
            from mmpo.practice.backends import build_backend

            backend = build_backend(config.extractor, policy=policy)
        self.updater = ExperienceUpdater(backend, agent_objective=config.agent_objective,
                                         learning_objective=config.learning_objective,
                                         num_experiences=config.num_experiences_per_query,
                                         given_ground_truth=config.given_ground_truth,
                                         retries=config.batch_update_retries)

    # ------------------------------------------------------------------ state

    def _config_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self.config)))

    def prepare(self, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
        """The state to start from, enforcing no-overwrite: an existing run needs ``resume`` or ``overwrite``."""
        state_path = self.out / "state.json"
        fresh = {"config": self._config_dict(), "next_step": 0, "total_steps": self.total_steps, "history": [],
                 "experiences": {}}
        if overwrite:
            for name in ("state.json", "experiences.json", "heldout.json"):
                (self.out / name).unlink(missing_ok=True)
            shutil.rmtree(self.out / "library", ignore_errors=True)
            return fresh
        if state_path.is_file():
            state = json.loads(state_path.read_text())
            if not resume:
                raise PracticeRunError(f"{self.out} holds a practice run (step {state['next_step']} of "
                                       f"{state['total_steps']}): pass --resume to continue it or --overwrite to "
                                       "start over")
            changed = sorted(k for k, v in self._config_dict().items() if state["config"].get(k) != v
                             and k != "output_dir")
            if changed:
                raise PracticeRunError(f"cannot resume {self.out}: the config differs in {', '.join(changed)}")
            return state
        if self.out.exists() and any(self.out.iterdir()):
            raise PracticeRunError(f"{self.out} exists and is not a practice run; choose another output_dir or "
                                   "pass --overwrite")
        return fresh

    # ------------------------------------------------------------------ one step

    def rollout(self, rows: list[dict[str, Any]], experiences: dict[str, str], *, seed: int) -> list[Group]:
        """``grpo_n`` sampled completions per row with the library in the prompt, scored by the rewards."""
        from mmpo.rewards import compute_rewards
        from mmpo.vlm.rollout import HFGenerateEngine

        config = self.config
        engine = HFGenerateEngine(self.model, self.processor, system_prompt=config.system_prompt)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            texts = list(engine.generate([with_library(r, experiences) for r in rows], num_samples=config.grpo_n,
                                         max_new_tokens=config.max_new_tokens,
                                         temperature=config.temperature).texts)
        flat_rows = [row for row in rows for _ in range(config.grpo_n)]
        total, _per_fn, _metrics = compute_rewards(config.rewards, texts, flat_rows)
        rewards = total.tolist()
        n = config.grpo_n
        return [Group(rows[i], texts[i * n:(i + 1) * n], rewards[i * n:(i + 1) * n]) for i in range(len(rows))]

    def step_rows(self, step: int) -> list[dict[str, Any]]:
        epoch, batch = divmod(step, self.num_batches)
        order = epoch_order(len(self.rows), epoch, seed=self.config.seed, shuffle=self.config.shuffle)
        size = self.config.batch_size
        return [self.rows[i] for i in order[batch * size:(batch + 1) * size]]

    def run(self, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
            stop_after: int | None = None, on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
        """Run (or continue) the loop; returns the final state. ``stop_after`` ends after that many steps this call."""
        from tqdm import tqdm

        state = self.prepare(resume=resume, overwrite=overwrite)
        experiences: dict[str, str] = dict(state["experiences"])
        start = state["next_step"]
        end = self.total_steps if stop_after is None else min(self.total_steps, start + stop_after)
        with tqdm(total=self.total_steps, initial=start, desc="practice", unit="step", disable=not progress) as bar:
            for step in range(start, end):
                epoch, batch = divmod(step, self.num_batches)
                groups = self.rollout(self.step_rows(step), experiences, seed=self.config.seed + step)
                experiences, stats = self.updater.run(groups, experiences)
                rewards = [r for g in groups for r in g.rewards]
                record = {"step": step, "epoch": epoch, "batch": batch,
                          "reward_mean": sum(rewards) / len(rewards),
                          "all_wrong_groups": sum(max(g.rewards) <= 0 for g in groups),
                          "all_right_groups": sum(min(g.rewards) >= 1 for g in groups),
                          "library_size": len(experiences), **stats.as_dict()}
                snapshot = {"version": step + 1, "step": step, "epoch": epoch, "batch": batch,
                            "experiences": experiences}
                atomic_write_json(self.out / "library" / f"step_{step:05d}.json", snapshot)
                atomic_write_json(self.out / "experiences.json", snapshot)
                state = {**state, "next_step": step + 1, "experiences": experiences,
                         "history": [*state["history"], record]}
                atomic_write_json(self.out / "state.json", state)  # the commit point
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", library=len(experiences))
                if on_step is not None:
                    on_step(step, record)
        if state["next_step"] == self.total_steps:
            atomic_write_text(self.out / "system_prompt.txt", self.deployed_system_prompt(experiences))
        if state["next_step"] == self.total_steps and self.config.val_size > 0 \
                and not (self.out / "heldout.json").is_file():
            atomic_write_json(self.out / "heldout.json", self.heldout(experiences, progress=progress))
        return state

    def deployed_system_prompt(self, experiences: dict[str, str]) -> str:
        """The policy's system prompt with the library appended (the official final agent config)."""
        base = self.config.system_prompt
        if base == "default":
            from mmpo.data import SYSTEM_PROMPT

            base = SYSTEM_PROMPT
        return system_with_experiences(base or "", experiences)

    def heldout(self, experiences: dict[str, str], *, progress: bool = False) -> dict[str, Any]:
        """Greedy held-out accuracy with the library in the prompt and without it (empty library, same template)."""
        from mmpo.eval.harness import evaluate

        rows = practice_rows(self.config, "test")
        result = {}
        for name, library in (("with_library", experiences), ("without_library", {})):
            summary = evaluate(self.model, self.processor, [with_library(r, library) for r in rows],
                               max_new_tokens=self.config.max_new_tokens, system_prompt=self.config.system_prompt,
                               progress=progress, description=f"held-out {name}")
            result[name] = summary["accuracy"]
        return {"num_items": len(rows), "library_size": len(experiences), **result}
