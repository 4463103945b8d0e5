"""LoRA adapters (peft), shared by the dLLM modules (``mmpo.dllm.rl``) and the VLM modules (``mmpo.algos``).

IGPO's and d1's official dLLM runs train a LoRA adapter (r 128, alpha 64, dropout 0.05 on q, k, v, o, up,
down, gate) on LLaDA-8B-Instruct, and their KL reference is the same network with the
adapter switched off. ``wrap_with_lora`` applies peft's LoRA; ``merged_state_dict`` gives
plain weights (base + adapter delta) under the base model's own key names, so the export
is an ordinary checkpoint that ``load_mask_predictor`` / ``mmpo eval`` read without peft.
peft's ``merge_adapter`` / ``unmerge_adapter`` would modify the weights in place and leave
a rounding residue in bf16; computing the merged tensors out of place avoids both.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Sequence

import torch


@dataclass
class LoraSettings:
    """LoRA adapter settings (defaults: IGPO / d1 official runs)."""

    r: int = 128
    """adapter rank"""
    alpha: int = 64
    """scaling numerator: the update is (alpha / r) * B A"""
    dropout: float = 0.05
    """dropout on the adapter input"""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"]
    )
    """names (suffixes) of the Linear layers that get an adapter; model-specific"""
    init_seed: int | None = None
    """seed of the adapter's random initialisation (peft's ``lora_A``; ``lora_B`` starts at zero), drawn
    from a forked RNG so the global streams are untouched; None = the global RNG. FSDP2 shards each
    process's own copy (it broadcasts nothing, unlike DDP), so sharded runs need the same seed everywhere"""


def wrap_with_lora(
    model: torch.nn.Module, settings: LoraSettings, *, exclude_prefixes: Sequence[str] = ()
) -> torch.nn.Module:
    """``model`` with trainable LoRA adapters on ``settings.target_modules``; base weights frozen.

    ``exclude_prefixes``: module-name prefixes that get no adapter (e.g. a VLM's vision tower,
    ``freeze_vision_tower``); passed to peft as an ``exclude_modules`` regex.
    """
    import re

    from peft import LoraConfig, get_peft_model

    if settings.r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {settings.r}")
    if not 0 <= settings.dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {settings.dropout}")
    excluded = tuple(exclude_prefixes)
    present = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.startswith(excluded)
    }
    missing = [t for t in settings.target_modules if t not in present]
    if len(missing) == len(settings.target_modules):
        raise ValueError(
            f"none of the LoRA target modules {settings.target_modules} is a Linear layer of this model"
            f"{' outside ' + str(list(excluded)) if excluded else ''}; its Linear layers are named {sorted(present)}"
        )
    exclude = "|".join(rf"{re.escape(prefix)}(\..*)?" for prefix in excluded) or None
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), exclude_modules=exclude, bias="none")
    if settings.init_seed is None:
        return get_peft_model(model, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.init_seed)
        return get_peft_model(model, config)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying transformers model (adapters stay active: peft injects them in place)."""
    return model.get_base_model() if is_lora(model) else model


def adapter_disabled(model: torch.nn.Module) -> ContextManager[Any]:
    """Context in which a LoRA model computes as its base model (the KL reference); no-op otherwise."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model carrying adapters."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Base weights + adapter deltas, keyed like the unwrapped base model's own state dict.

    ``state``: the base model's weights to merge instead of its own ``state_dict()``, keyed the same way
    (e.g. the gathered full weights of an FSDP2-sharded model, ``mmpo.vlm.fsdp.full_state_dict``). The
    delta is peft's plain-LoRA ``scaling * B @ A`` (transposed for ``fan_in_fan_out``), in float32.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import transpose

    base = model.get_base_model()
    if state is None:
        state = base.state_dict()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = 0
            for adapter in module.active_adapters:
                if module.use_dora.get(adapter, False):
                    raise ValueError(f"{name}: a DoRA adapter; the merged export adds plain LoRA deltas (B A x scaling) only, "
                                     "and mmpo's LoRA settings never create DoRA (use_dora)")
                a, b = (state[f"{name}.lora_{part}.{adapter}.weight"].float() for part in "AB")
                delta = delta + transpose(b @ a, module.fan_in_fan_out) * module.scaling[adapter]
            deltas[f"{name}.base_layer.weight"] = delta
    merged = {}
    for key, value in state.items():
        if "lora_" in key:
            continue
        if key in deltas:
            value = (value.float() + deltas[key]).to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value
    return merged


def save_merged_and_adapter(model: torch.nn.Module, path: str | Path, state: dict[str, Any] | None = None) -> None:
    """Merged weights (loadable without peft) in ``path`` and the adapter alone in ``path / "adapter"``.

    ``state``: the base model's full weights to write instead of its own (see :func:`merged_state_dict`).
    """
    path = Path(path)
    model.get_base_model().save_pretrained(path, state_dict=merged_state_dict(model, state), safe_serialization=True)
    # peft picks the adapter tensors out of the PeftModel's own state-dict keys (base_model.model.<base key>)
    adapter = None if state is None else {f"base_model.model.{k}": v for k, v in state.items() if "lora_" in k}
    model.save_pretrained(path / "adapter", state_dict=adapter)
