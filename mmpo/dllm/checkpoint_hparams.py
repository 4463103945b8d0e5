"""Checkpoints of the dLLM modules that load with ``torch.load(weights_only=True)``.

The modules take dataclass settings (``SamplerConfig``, ``HintConfig``, ...) so that
LightningCLI can type-check YAML. ``save_hyperparameters`` would pickle those dataclass
objects into every checkpoint, and torch's default safe loader refuses unknown classes,
so a resume (``ckpt_path=...``) would fail. Checkpoints store them as plain dicts instead,
and the constructors accept either form (``as_config``). Checkpoints of before the config groups
(flat ``lr``, ``beta`` ...) load through :class:`LegacyHparamsMixin`.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

T = TypeVar("T")


def as_config(value: T | dict[str, Any] | None, cls: type[T]) -> T:
    """``value`` as a ``cls`` instance: defaults for None, fields for a dict (from a checkpoint)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected {cls.__name__}, a dict of its fields or None, got {type(value).__name__}")
    return value


class PlainHparamsMixin:
    """LightningModule mixin: dataclass hyperparameters go into checkpoints as dicts."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        hparams = checkpoint.get("hyper_parameters")
        if hparams:
            for key, value in list(hparams.items()):
                if is_dataclass(value) and not isinstance(value, type):
                    hparams[key] = asdict(value)


def _yaml_plain(value: Any) -> Any:
    """Tuples as lists, recursively (``yaml.safe_dump`` writes no tuples)."""
    if isinstance(value, (list, tuple)):
        return [_yaml_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _yaml_plain(v) for k, v in value.items()}
    return value


class LegacyHparamsMixin:
    """LightningModule mixin: ``load_from_checkpoint`` also reads checkpoints saved with the flat settings of
    before the config groups (``lr``, ``beta``, ``ratio_level`` ...): their hyperparameters are turned into the
    groups (:func:`mmpo.dllm.config.grouped_hparams`) and given to Lightning as its ``hparams_file``, which
    replaces the checkpoint's. A grouped checkpoint loads as Lightning loads it."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, **kwargs: Any) -> Any:
        from mmpo.dllm.config import grouped_hparams, is_flat_hparams

        load = super().load_from_checkpoint  # type: ignore[misc]
        if hparams_file is not None or not isinstance(checkpoint_path, (str, Path)):
            return load(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        # memory-mapped: only the hyperparameters are read here, the weights by Lightning's load
        saved = torch.load(checkpoint_path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters")
        if not saved or not is_flat_hparams(saved):
            return load(checkpoint_path, map_location, hparams_file, strict, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            grouped = Path(tmp) / "hparams.yaml"
            grouped.write_text(yaml.safe_dump(_yaml_plain(grouped_hparams(saved))))
            return load(checkpoint_path, map_location, grouped, strict, **kwargs)
