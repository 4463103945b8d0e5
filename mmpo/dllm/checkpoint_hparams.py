"""Checkpoints of the dLLM modules that load with ``torch.load(weights_only=True)``.

The modules take dataclass settings (``SamplerConfig``, ``HintConfig``, ...) so that
LightningCLI can type-check YAML. ``save_hyperparameters`` would pickle those dataclass
objects into every checkpoint, and torch's default safe loader refuses unknown classes,
so a resume (``ckpt_path=...``) would fail. Checkpoints store them as plain dicts instead,
and the constructors accept either form (``as_config``).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any, TypeVar

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
