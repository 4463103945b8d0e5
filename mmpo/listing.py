"""``mmpo list [REGISTRY]``: the names a user picks from in a config, each with a one-line description.

Every table is read from its registry (nothing here repeats a name):

- ``algorithms``: the LightningModule classes of ``mmpo.algos``, ``mmpo.dllm`` and ``mmpo.robotics`` that
  train (they define ``training_step``), as ``model.class_path`` values;
- ``advantages`` / ``losses``: ``mmpo.core.ADVANTAGE_ESTIMATORS`` / ``POLICY_LOSSES``;
- ``kl`` / ``aggregation``: ``mmpo.core.KL_KINDS`` / ``AGGREGATION_MODES`` (descriptions:
  ``KL_KIND_DESCRIPTIONS`` / ``AGGREGATION_DESCRIPTIONS`` beside the enums);
- ``rewards``: ``mmpo.rewards.REWARDS``; ``benchmarks``: ``mmpo.eval.registry.available_benchmarks()``;
- ``robot-tasks``: ``mmpo.robotics.envs.tasks.TASKS``.

A description is the first sentence of the registered object's docstring. Without the ``robotics`` extra
the robot tables (and the robot algorithms) are left out and one line names the extra that adds them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from typing import Callable, Sequence

from mmpo._extras import EXTRA_MODULES, missing_extra_message, missing_modules

# packages whose modules define the trainable LightningModules (robotics only with its extra)
ALGORITHM_PACKAGES: tuple[str, ...] = ("mmpo.algos", "mmpo.dllm")
ROBOTICS_PACKAGE = "mmpo.robotics"


@dataclass(frozen=True)
class Entry:
    """One name a config can use and what it is."""

    name: str
    description: str


def first_sentence(doc: str | None) -> str:
    """The docstring's first paragraph on one line, cut after its first sentence when there are several."""
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(line.strip() for line in paragraph.splitlines())
    end = text.find(". ")
    return text[: end + 1] if end != -1 else text


def robotics_available() -> bool:
    return not missing_modules(EXTRA_MODULES["robotics"])


def robotics_missing_line() -> str:
    """The one line saying which extra adds the robot tables."""
    return missing_extra_message(ROBOTICS_PACKAGE, "robotics", missing_modules(EXTRA_MODULES["robotics"])) + \
        "; it adds the robot algorithms and robot-tasks"


def _import_package_modules(package: str) -> None:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if ".demos" in info.name or ".bench" in info.name:  # scripts and experts, no modules to train
            continue
        importlib.import_module(info.name)


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _subclasses(sub)
    return found


def algorithms() -> list[Entry]:
    """Trainable mmpo LightningModules (the ``model.class_path`` values), sorted by class path."""
    from lightning.pytorch import LightningModule

    packages = [*ALGORITHM_PACKAGES, *([ROBOTICS_PACKAGE] if robotics_available() else [])]
    for package in packages:
        _import_package_modules(package)
    entries = []
    for cls in _subclasses(LightningModule):
        path = f"{cls.__module__}.{cls.__qualname__}"
        if not path.startswith(tuple(f"{p}." for p in packages)) or cls.__name__.startswith("_"):
            continue
        if cls.training_step is LightningModule.training_step:  # a base class, nothing to train
            continue
        entries.append(Entry(path, first_sentence(cls.__doc__)))
    return sorted(entries, key=lambda e: e.name)


def advantages() -> list[Entry]:
    from mmpo.core import ADVANTAGE_ESTIMATORS

    return [Entry(n, first_sentence(ADVANTAGE_ESTIMATORS.get(n).__doc__)) for n in ADVANTAGE_ESTIMATORS.names()]


def losses() -> list[Entry]:
    from mmpo.core import POLICY_LOSSES

    return [Entry(n, first_sentence(POLICY_LOSSES.get(n).__doc__)) for n in POLICY_LOSSES.names()]


def kl_kinds() -> list[Entry]:
    from mmpo.core.kl import KL_KIND_DESCRIPTIONS, KL_KINDS

    return [Entry(n, KL_KIND_DESCRIPTIONS[n]) for n in KL_KINDS]


def aggregation_modes() -> list[Entry]:
    from mmpo.core.aggregate import AGGREGATION_DESCRIPTIONS, AGGREGATION_MODES

    return [Entry(n, AGGREGATION_DESCRIPTIONS[n]) for n in AGGREGATION_MODES]


def rewards() -> list[Entry]:
    from mmpo.rewards import REWARDS
    from mmpo.rewards import step  # noqa: F401  (registers StepGRPO's step_rar* / step_rvr rewards)

    return [Entry(n, first_sentence(REWARDS[n].__doc__)) for n in sorted(REWARDS)]


def benchmarks() -> list[Entry]:
    from mmpo.data.synthetic import TESTBED_TASKS, TEXT_TASKS, TEXT_TEACHER_TASKS
    from mmpo.data.synthetic.registry import get_task
    from mmpo.eval.registry import (BENCHMARKS, FILE_PREFIX, LOCAL_BENCHMARKS, SYNTH_PREFIX,
                                    available_benchmarks)

    entries = []
    for name in available_benchmarks():
        if name in LOCAL_BENCHMARKS:
            text = f"[{LOCAL_BENCHMARKS[name].modality}] {LOCAL_BENCHMARKS[name].description}"
        elif name in BENCHMARKS:
            text = f"[{BENCHMARKS[name].modality}] {BENCHMARKS[name].description}"
        elif name == f"{SYNTH_PREFIX}all":
            text = "[vlm] every synthetic task"
        elif name == f"{SYNTH_PREFIX}text":
            text = "[text] every synthetic text-LM task (long arithmetic, word problems, countdown)"
        elif name.startswith(SYNTH_PREFIX):
            task = name[len(SYNTH_PREFIX):]
            kind = "text" if task in (*TEXT_TASKS, *TEXT_TEACHER_TASKS, *TESTBED_TASKS) else "vlm"
            text = f"[{kind}] synthetic: {first_sentence(get_task(task).__doc__)}"
        elif name.startswith(FILE_PREFIX):
            text = "rows from a local JSONL file"
        else:
            text = ""
        entries.append(Entry(name, text.strip()))
    return entries


def robot_tasks() -> list[Entry]:
    from mmpo.robotics.envs.tasks import TASKS

    return [Entry(n, f"{s.family} {s.sim_name}: obs {s.obs_dim}-D, action {s.action_dim}-D, "
                     f"{s.max_episode_steps} steps{'' if s.expert is None else ', scripted expert (mmpo demos)'}")
            for n, s in sorted(TASKS.items())]


# name -> (title, lister, needs the robotics extra)
REGISTRIES: dict[str, tuple[str, Callable[[], list[Entry]], bool]] = {
    "algorithms": ("algorithms (model.class_path)", algorithms, False),
    "advantages": ("advantage estimators (advantage.name)", advantages, False),
    "losses": ("policy losses (loss.name)", losses, False),
    "kl": ("KL kinds (loss.kl_kind)", kl_kinds, False),
    "aggregation": ("aggregation modes (loss.agg)", aggregation_modes, False),
    "rewards": ("reward functions (rewards.weights keys)", rewards, False),
    "benchmarks": ("benchmarks (mmpo eval --benchmarks)", benchmarks, False),
    "robot-tasks": ("robot tasks (task)", robot_tasks, True),
}


def format_table(title: str, entries: Sequence[Entry]) -> str:
    width = max((len(e.name) for e in entries), default=0)
    return "\n".join([f"{title}:", *(f"  {e.name:<{width}}  {e.description}".rstrip() for e in entries)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmpo list", description="List the registered names a config picks from.")
    parser.add_argument("registry", nargs="?", choices=list(REGISTRIES), help="one registry (default: all)")
    args = parser.parse_args(argv)
    names = [args.registry] if args.registry else list(REGISTRIES)
    robotics = robotics_available()
    blocks = [format_table(REGISTRIES[n][0], REGISTRIES[n][1]()) for n in names if robotics or not REGISTRIES[n][2]]
    print("\n\n".join(blocks))
    if not robotics and (args.registry in (None, "algorithms", "robot-tasks")):
        print(("\n" if blocks else "") + robotics_missing_line())
    return 0


__all__ = ["Entry", "REGISTRIES", "first_sentence", "main"]
