"""``--ckpt_path`` resumes the run the config and command line describe.

LightningCLI (``LightningCLI._parse_ckpt_path``) replaces the model arguments of the config
and the command line with the hyperparameters saved in the checkpoint, silently: a resumed
run ignored ``--model.init_args.optim.lr 0.5`` and exported into the checkpoint's ``output_dir``.
The rule here instead (:class:`ResumeArgsMixin`):

1. the config and the command line win: model and data are built from them;
2. every difference from the checkpoint's saved hyperparameters is printed, one line per key
   (``model.init_args.optim.lr: checkpoint=0.0001 now=0.5``), before anything is built;
3. a difference that breaks resumption is an error before training starts: another module or
   data class, an argument in :data:`RESUME_FIXED_ARGS` (the base model, the rollout group,
   the data order), or any parameter whose shape or name no longer matches the checkpoint's;
4. optimizer settings (lr, weight decay, betas, ...) come from the config too: Lightning
   restores the optimizer's state dict, settings included, so :class:`KeepConfiguredOptimizerSettings`
   puts the configured values back after the restore (moments and step counts stay); a
   scheduler's base lr follows, its position (``last_epoch``) stays.

A checkpoint path with no model class in the config (``mmpo validate --ckpt_path X`` alone)
keeps Lightning's behaviour: the checkpoint's hyperparameters build the model.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import lightning.pytorch as pl
import torch
import yaml
from lightning.fabric.utilities.rank_zero import rank_zero_only

from mmpo.training.cli_errors import fail
from mmpo.training.legacy_hparams import upgrade_saved_hparams

# Arguments a resumed run must keep, per class (subclasses inherit their bases' entries). Each
# makes the checkpoint mean something else: the weights belong to one base model, a step's
# rollout shape is G completions per prompt, the saved data position counts batches of one
# shuffled list of rows. Shape-defining settings not listed are caught by the shape check.
RESUME_FIXED_ARGS: dict[str, tuple[str, ...]] = {
    "mmpo.algos.grpo.GRPOModule": ("model_path", "sampling.num_generations"),
    "mmpo.algos.sft.SFTModule": ("model_path",),
    "mmpo.dllm.rl.DiffuGRPO": ("model_path", "group_size"),
    "mmpo.dllm.sft.MaskedDiffusionSFT": ("init_from", "tokenizer_task"),
    "mmpo.robotics.bc.BCModule": ("obs_dim", "action_dim", "horizon", "backbone"),
    "mmpo.data.resumable.ResumableTrainData": (
        "batch_size", "seed", "train_size", "tasks", "task", "data_path", "train_path", "difficulty", "drop_last",
    ),
    "mmpo.robotics.bc.ChunkDataModule": ("dataset_path", "horizon", "batch_size", "seed"),
}
# Keys Lightning adds to saved hyperparameters; not arguments.
_INTERNAL_KEYS = ("_class_path", "_instantiator")
_MISSING = object()


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A sharded (FSDP2, torch.distributed.checkpoint) checkpoint: a directory with Lightning's ``meta.pt``."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return Path(path).is_dir() and (Path(path) / _METADATA_FILENAME).is_file()


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint's dict, memory-mapped (tensors are not read until used).

    For a sharded checkpoint: its ``meta.pt`` (hyperparameters, trainer state), with ``state_dict``
    holding the saved weights' shapes (``torch.Size``, from the shards' metadata) instead of tensors.
    """
    if not is_sharded_checkpoint(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = torch.load(Path(path) / _METADATA_FILENAME, map_location="cpu", weights_only=True)
    prefix = "state_dict."  # FSDP2Strategy / ModelParallelStrategy save the weights under "state_dict"
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    checkpoint["state_dict"] = {key[len(prefix):]: torch.Size(meta.size) for key, meta in stored.items()
                                if key.startswith(prefix) and hasattr(meta, "size")}
    return checkpoint


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively, so a YAML dump and a saved value compare equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(not set)"
    return repr(value) if isinstance(value, str) else str(value)


def hparam_differences(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    """``(key, checkpoint value, current value)`` for every argument that differs.

    ``saved`` is a checkpoint's ``hyper_parameters`` (``_class_path`` + arguments), ``now`` the
    config's ``{"class_path", "init_args"}`` for the same section. A config group (a dict on both sides,
    e.g. ``sampling``, mmpo.training.config) is compared field by field (``...init_args.sampling.top_p``).
    """
    differences = []
    saved_class, now_class = saved.get("_class_path"), now.get("class_path")
    if saved_class is not None and now_class is not None and saved_class != now_class:
        differences.append((f"{prefix}.class_path", saved_class, now_class))
    now_args = now.get("init_args") or {}
    saved_args = {k: v for k, v in saved.items() if k not in _INTERNAL_KEYS}
    for key in sorted(set(saved_args) | set(now_args)):
        before, after = saved_args.get(key, _MISSING), now_args.get(key, _MISSING)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            for field in sorted(set(before) | set(after)):
                old, new = before.get(field, _MISSING), after.get(field, _MISSING)
                if old is _MISSING or new is _MISSING or _plain(old) != _plain(new):
                    differences.append((f"{prefix}.init_args.{key}.{field}", old, new))
        elif before is _MISSING or after is _MISSING or _plain(before) != _plain(after):
            differences.append((f"{prefix}.init_args.{key}", before, after))
    return differences


def fixed_args_for(class_path: str | None) -> set[str]:
    """The :data:`RESUME_FIXED_ARGS` entries of ``class_path`` and its base classes."""
    if not class_path:
        return set()
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return set(RESUME_FIXED_ARGS.get(class_path, ()))
    fixed: set[str] = set()
    for base in getattr(cls, "__mro__", (cls,)):
        fixed.update(RESUME_FIXED_ARGS.get(f"{base.__module__}.{base.__qualname__}", ()))
    return fixed


def resume_conflicts(differences: Iterable[tuple[str, Any, Any]], fixed: set[str]) -> list[tuple[str, Any, Any]]:
    """The differences that break resumption: a class change or a fixed argument present in both
    (``fixed`` names an argument as under ``init_args``: ``model_path``, ``sampling.num_generations``)."""
    conflicts = []
    for key, before, after in differences:
        name = key.split(".init_args.", 1)[-1]
        if key.endswith(".class_path") or (name in fixed and before is not _MISSING and after is not _MISSING):
            conflicts.append((key, before, after))
    return conflicts


def state_dict_mismatches(module: torch.nn.Module, saved_shapes: Mapping[str, tuple[int, ...]],
                          *, strict: bool = True) -> list[str]:
    """Parameter/buffer names whose shape differs, plus (when ``strict``) missing and unexpected names."""
    current = {name: tuple(t.shape) for name, t in module.state_dict().items() if isinstance(t, torch.Tensor)}
    problems = [f"{name} checkpoint={list(saved_shapes[name])} now={list(shape)}"
                for name, shape in current.items() if name in saved_shapes and tuple(saved_shapes[name]) != shape]
    if strict:
        problems += [f"{name} missing from the checkpoint" for name in current if name not in saved_shapes]
        problems += [f"{name} only in the checkpoint" for name in saved_shapes if name not in current]
    return problems


@rank_zero_only
def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class KeepConfiguredOptimizerSettings(pl.Callback):
    """After a resume, the optimizers use the configured settings, not the checkpoint's.

    Lightning configures the optimizers (``on_fit_start`` sees them fresh), then loads their
    saved state dicts, which carry the old ``lr``/``weight_decay``/... in each param group.
    ``on_train_start`` (after the restore, before the first batch) puts the configured values
    back. A scheduled lr keeps its place in the schedule: it is scaled by new/old base lr.
    """

    def __init__(self) -> None:
        self._configured: list[list[dict[str, Any]]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._configured = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
                            for opt in trainer.optimizers]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None or not self._configured:
            return
        for optimizer, configured in zip(trainer.optimizers, self._configured):
            for group, wanted in zip(optimizer.param_groups, configured):
                _apply_group_settings(group, wanted)
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in scheduler.optimizer.param_groups]
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        self._configured = []


def _apply_group_settings(group: dict[str, Any], wanted: Mapping[str, Any]) -> None:
    old_initial = group.get("initial_lr")
    for key, value in wanted.items():
        if key not in ("lr", "initial_lr"):
            group[key] = value
    if "initial_lr" in wanted and old_initial:
        # under a scheduler: lr = initial_lr x schedule factor; keep the factor, change the base
        group["lr"] = group["lr"] * wanted["initial_lr"] / old_initial
        group["initial_lr"] = wanted["initial_lr"]
    else:
        group["lr"] = wanted["lr"]


class ResumeArgsMixin:
    """LightningCLI mixin: with ``--ckpt_path``, the config and command line win (see module doc)."""

    config: Any
    parser: Any
    model: pl.LightningModule
    trainer: pl.Trainer

    def _parse_ckpt_path(self) -> None:
        self._resume_checkpoint: dict[str, Any] | None = None
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        model_config = self.config[subcommand].get("model")
        if not ckpt_path or not (Path(ckpt_path).is_file() or is_sharded_checkpoint(ckpt_path)):
            return  # "last" / "best": Lightning resolves them at fit time
        if model_config is None or not getattr(model_config, "class_path", None):
            self._model_from_checkpoint(ckpt_path)  # nothing configured: the checkpoint's hparams
            return
        try:
            checkpoint = read_checkpoint(ckpt_path)
        except Exception:  # noqa: BLE001 - unreadable: Lightning's own load reports it (with the checkpoint checks)
            return
        current = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, skip_none=False,
                                                  format="yaml"))[subcommand]
        differences, conflicts = [], []
        for section, saved_key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
            saved, now = checkpoint.get(saved_key), current.get(section)
            saved = upgrade_saved_hparams(saved) if isinstance(saved, Mapping) else saved
            if not saved or not isinstance(now, Mapping):
                continue
            found = hparam_differences(saved, now, section)
            differences += found
            # validate/test only read the weights (the shape check below); the training contract matters to fit
            fixed = fixed_args_for(now.get("class_path")) if subcommand == "fit" else set()
            conflicts += resume_conflicts(found, fixed)
        if differences:
            _print(f"resuming from {ckpt_path}: settings that differ from the checkpoint's "
                   "(the config and command line win):")
            for key, before, after in differences:
                _print(f"  {key}: checkpoint={_shown(before)} now={_shown(after)}")
        if conflicts:
            listed = "; ".join(f"{key} (checkpoint={_shown(b)} now={_shown(a)})" for key, b, a in conflicts)
            fail(subcommand, f"cannot resume from {ckpt_path}: {listed} must stay as in the checkpoint to resume. "
                             "Keep the checkpoint's value, or start a new run without --ckpt_path "
                             "(e.g. from the exported weights).")
        self._resume_checkpoint = checkpoint

    def _model_from_checkpoint(self, ckpt_path: str) -> None:
        """Lightning's own rule (the checkpoint's hyperparameters build the model), on the hyperparameters
        as today's modules name them (:func:`mmpo.training.legacy_hparams.upgrade_saved_hparams`)."""
        if not Path(ckpt_path).is_file():
            return
        hparams = upgrade_saved_hparams(read_checkpoint(ckpt_path).get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def instantiate_classes(self) -> None:
        super().instantiate_classes()  # type: ignore[misc]
        checkpoint = getattr(self, "_resume_checkpoint", None)
        if checkpoint is None:
            return
        saved = checkpoint.get("state_dict") or {}  # tensors, or shapes (a sharded checkpoint, read_checkpoint)
        shapes = {k: tuple(v) if isinstance(v, torch.Size) else tuple(v.shape) for k, v in saved.items()}
        problems = state_dict_mismatches(self.model, shapes,
                                         strict=getattr(self.model, "strict_loading", True))
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            fail(self.config.get("subcommand"),
                 f"cannot resume from {self.config[self.config.subcommand].ckpt_path}: the configured model does not "
                 f"match the checkpoint's weights ({shown}). Use the checkpoint's model settings, or start a new run "
                 "without --ckpt_path.")
        self._resume_checkpoint = None  # the weights are read again by Lightning; drop the mapping
        self.trainer.callbacks.insert(0, KeepConfiguredOptimizerSettings())
