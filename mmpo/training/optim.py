"""The one place every family builds its optimizer: AdamW plus the learning-rate schedule.

Every ``configure_optimizers`` (VLM, T-PPO, dLLM SFT and RL, robot BC, DPPO and its Gaussian
baseline) calls :func:`make_adamw` or :func:`make_optimizer`; a family only chooses its parameter
groups and settings. ``fused`` is a per-family choice because it is not free: torch's fused kernel
and its default (foreach) path implement the same update but round differently, and the recorded
golden runs of each family were made with the path it uses today (the VLM modules fused, the
others not).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Union

import torch

from mmpo.training.lr_schedule import SCHEDULES, warmup_schedule

ParamsOrGroups = Union[Iterable[torch.nn.Parameter], Iterable[Mapping[str, Any]]]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _trainable(params: ParamsOrGroups) -> list[Any]:
    """Parameters (or param groups) with the frozen parameters left out (LoRA: only the adapter)."""
    items = list(params)
    if items and isinstance(items[0], Mapping):
        return [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in items]
    return [p for p in items if p.requires_grad]


def make_adamw(
    params: ParamsOrGroups,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the trainable ``params`` (a parameter iterable or torch param groups).

    ``fused=True`` asks for torch's fused kernel (one kernel for all parameters; CPU and CUDA,
    floating-point parameters) and falls back to the default path where the device or dtype has none.

    Every step of the returned optimizer bumps its parameters' in-place version counters (``p._version``),
    as any in-place torch op does. torch's fused kernel writes the parameters without bumping them (torch
    2.13 / 2.14), so a fused optimizer gets a step post-hook that does (:func:`_bump_versions`): the vLLM
    rollout engine reads the counters to know that the policy changed and its copy must be synced.
    """
    _require(lr > 0, f"lr must be > 0, got {lr}")
    _require(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
    settings = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    trainable = _trainable(params)
    if fused:
        try:
            optimizer = torch.optim.AdamW(trainable, fused=True, **settings)
        except RuntimeError:  # a device / dtype without the fused kernel
            pass
        else:
            optimizer.register_step_post_hook(_bump_versions)
            return optimizer
    return torch.optim.AdamW(trainable, **settings)


def _bump_versions(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step post-hook: mark every parameter of ``optimizer`` modified in place (its version counter + 1)."""
    torch.autograd.graph.increment_version([p for group in optimizer.param_groups for p in group["params"]])


def make_optimizer(
    params: ParamsOrGroups,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool = False,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> dict[str, Any]:
    """:func:`make_adamw` with linear warm-up then constant / linear / cosine decay, stepped per optimizer
    step (:func:`mmpo.training.lr_schedule.warmup_schedule`). Returns Lightning's ``configure_optimizers`` dict."""
    _require(warmup_steps >= 0, f"warmup_steps must be >= 0, got {warmup_steps}")
    _require(schedule in SCHEDULES, f"unknown schedule {schedule!r}; valid: {list(SCHEDULES)}")
    if schedule != "constant":
        _require(total_steps is not None and total_steps > 0,
                 f"schedule {schedule!r} needs a positive total_steps (set trainer.max_steps)")
    optimizer = make_adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused)
    scheduler = warmup_schedule(optimizer, warmup_steps=warmup_steps, schedule=schedule, total_steps=total_steps,
                                min_lr_ratio=min_lr_ratio)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def max_steps_or_none(module: Any) -> int | None:
    """The attached trainer's ``max_steps`` when positive (the decay horizon), else None."""
    trainer = getattr(module, "_trainer", None)
    return trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None
