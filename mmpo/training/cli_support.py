"""``MMPOLightningCLI``: Lightning's CLI with mmpo's run guards on every Trainer it builds.

Every ``mmpo fit|validate|test`` Trainer gets ``VerifiedCheckpointIO`` (atomic, checksummed
checkpoints that refuse to load when damaged) and ``RunDirectoryLock`` (one run per checkpoint
directory; ``last.ckpt`` is always the newest run's), ``PreemptionCheckpoint`` (SIGTERM / SIGUSR1 save
``last.ckpt`` at a step boundary and exit 128 + signal) unless the config names one, and, unless the config names a progress bar
or disables it, ``StepProgressBar`` (``step k/max_steps`` with an ETA) instead of Lightning's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Sequence

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from mmpo.training.checkpoint import (install_verified_checkpoint_io, previous_path, refuse_if_damaged,
                                      resolve_resume_path)
from mmpo.training.preemption import PreemptionCheckpoint
from mmpo.training.progress import StepProgressBar
from mmpo.training.run_lock import RunDirectoryLock


class MMPOLightningCLI(LightningCLI):
    """``LightningCLI`` whose Trainers carry the verified checkpoint IO and the run-directory lock."""

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # LightningCLI appends ``trainer_defaults["callbacks"]`` to the config's callbacks.
        trainer_defaults = dict(trainer_defaults or {})
        extra = trainer_defaults.get("callbacks") or []
        trainer_defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), RunDirectoryLock()]
        super().__init__(*args, trainer_defaults=trainer_defaults, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads --ckpt_path's hyperparameters with a bare torch.load next: verify it first.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path == "last":
            ckpt_path = self._damaged_last_checkpoint(subcommand) or ckpt_path
        if ckpt_path and ckpt_path not in LIGHTNING_CKPT_KEYWORDS:
            # a kill during a save may leave last.ckpt missing or newer than its sidecar: take the newest good one
            resolved, reason = resolve_resume_path(ckpt_path)
            if reason is not None:
                print(f"mmpo {subcommand}: {reason}", file=sys.stderr, flush=True)
                self.config[subcommand]["ckpt_path"] = str(resolved)
            if resolved.is_file():
                refuse_if_damaged(resolved)

    def _damaged_last_checkpoint(self, subcommand: str) -> str | None:
        """``--ckpt_path last``: Lightning picks the newest ``last*.ckpt`` of the checkpoint callbacks' folders
        without checking it. When a configured folder's ``last.ckpt`` is missing or does not verify (a kill
        during its save), its path is returned so that the fallback to the newest good checkpoint applies."""
        callbacks = (self.config[subcommand].get("trainer") or {}).get("callbacks") or []
        for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
            class_path = str(getattr(callback, "class_path", "") or "")
            dirpath = (getattr(callback, "init_args", None) or {}).get("dirpath")
            if not class_path.endswith("ModelCheckpoint") or not dirpath:
                continue
            last = Path(dirpath) / "last.ckpt"
            if last.exists() or previous_path(last).exists():
                return str(last) if resolve_resume_path(last)[1] is not None else None
        return None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # copied before the Trainer is built: it appends its default bar to this very list
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]
        trainer = super().instantiate_trainer(**kwargs)
        install_verified_checkpoint_io(trainer)
        if not any(isinstance(cb, PreemptionCheckpoint) for cb in trainer.callbacks):
            # first, so that on an exception it saves before RunDirectoryLock lets go of the directory
            trainer.callbacks.insert(0, PreemptionCheckpoint())  # a configured one keeps its settings
        replace_default_progress_bar(trainer, configured)
        return trainer


def replace_default_progress_bar(trainer: Trainer, configured_callbacks: list[Any]) -> None:
    """Swap the progress bar Lightning added by default for ``StepProgressBar``.

    A bar the user configured (any ``ProgressBar`` among ``configured_callbacks``) is kept, and with
    ``enable_progress_bar: false`` there is no bar to swap.
    """
    default_bar = trainer.progress_bar_callback
    if default_bar is None or any(isinstance(cb, ProgressBar) for cb in configured_callbacks):
        return
    trainer.callbacks[trainer.callbacks.index(default_bar)] = StepProgressBar()


#: ``ckpt_path`` values Lightning resolves itself
LIGHTNING_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")

_NESTED_KEY = re.compile(r"^--(model\.init_args\.[\w.]+)\.(\w+)$")
_YAML_NULLS = ("null", "Null", "NULL", "~")


def nested_nulls_as_mappings(argv: Sequence[str]) -> list[str]:
    """``--model.init_args.loss.clip_low=null`` as ``--model.init_args.loss={clip_low: null}``.

    A field of a config group (mmpo.training.config) set to null on the command line reaches
    jsonargparse (4.x, subclass mode) as the string ``'None'`` and is refused as "not a float"; the
    mapping form sets the same field (the group's other values are kept) and parses. Other
    arguments, and other values, pass unchanged.
    """
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        consumed = 1
        if not eq and i + 1 < len(args) and _NESTED_KEY.match(key):
            value, consumed = args[i + 1], 2  # ``--key value``
        match = _NESTED_KEY.match(key)
        if match and value in _YAML_NULLS and (eq or consumed == 2):
            out.append(f"--{match.group(1)}={{{match.group(2)}: null}}")
        else:
            out.extend(args[i:i + consumed])
        i += consumed
    return out
