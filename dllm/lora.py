"""LoRA adapters (peft) for real-scale dLLM RL, as in IGPO's and d1's official runs.

Both official runs train a LoRA adapter (r 128, alpha 64, dropout 0.05 on q, k, v, o, up,
down, gate) on LLaDA-8B-Instruct, and their KL reference is the same network with the
adapter switched off. ``wrap_with_lora`` applies peft's LoRA; ``merged_state_dict`` gives
plain weights (base + adapter delta) under the base model's own key names, so the export
is an ordinary checkpoint that ``load_mask_predictor`` / ``mmpo eval`` read without peft.
peft's ``merge_adapter`` / ``unmerge_adapter`` would modify the weights in place and leave
a rounding residue in bf16; computing the merged tensors out of place avoids both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def wrap_with_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """``model`` with trainable LoRA adapters on ``settings.target_modules``; base weights frozen."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in settings.target_modules if t not in present]
    if len(missing) == len(settings.target_modules):
        raise ValueError(
            f"none of the LoRA target modules {settings.target_modules} is a Linear layer of this model; "
            f"its Linear layers are named {sorted(present)}"
        )
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none")
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model carrying adapters."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """Base weights + adapter deltas, keyed like the unwrapped base model's own state dict."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            deltas[f"{name}.base_layer.weight"] = delta
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        state[key.replace(".base_layer.", ".")] = value
    return state
