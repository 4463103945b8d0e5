"""Learning-rate schedules of every family: linear warm-up, then constant / linear / cosine decay.

Built from torch's own schedulers (``LinearLR``, ``CosineAnnealingLR``, ``ConstantLR`` chained by
``SequentialLR``) rather than a hand-written ``LambdaLR``. The factor at scheduler step ``s`` is

- warm-up (``s < warmup_steps``): ``(s + 1) / warmup_steps`` (the first step already trains);
- then, with ``p = (s - warmup_steps) / (total_steps - warmup_steps)``: constant ``1``, linear
  ``1 - p``, or cosine ``floor + (1 - floor) (1 + cos(pi p)) / 2``;
- after ``total_steps`` the last value is held (cosine does not rise again).

``transformers.get_scheduler`` is not used because its warm-up factor is ``s / warmup_steps``
(a first step at learning rate 0), which would change every recorded run.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

SCHEDULES = ("constant", "linear", "cosine")
_FOREVER = 2**62  # ConstantLR's total_iters for a phase that never ends


def warmup_schedule(
    optimizer: Optimizer,
    *,
    warmup_steps: int = 0,
    schedule: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> LRScheduler:
    """Linear warm-up over ``warmup_steps`` scheduler steps, then ``schedule`` down to step ``total_steps``.

    Args:
        optimizer: its param groups' current ``lr`` is the peak learning rate.
        warmup_steps: scheduler steps of linear warm-up (0 = none).
        schedule: after warm-up: ``constant``, ``linear`` (to 0) or ``cosine`` (to ``min_lr_ratio``).
        total_steps: scheduler steps of the whole run; needed by ``linear`` and ``cosine``.
        min_lr_ratio: cosine's final learning rate as a fraction of the peak.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {list(SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if schedule != "constant" and (total_steps is None or total_steps < 1):
        raise ValueError(f"schedule {schedule!r} needs a positive total_steps, got {total_steps}")
    peak = optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])  # before any phase scales it
    phases: list[LRScheduler] = []
    milestones: list[int] = []
    if warmup_steps > 0:
        phases.append(LinearLR(optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1))
        milestones.append(warmup_steps)
    if schedule == "constant":
        phases.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
    else:
        decay_steps = max(1, total_steps - warmup_steps)
        if schedule == "linear":
            phases.append(LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=decay_steps))
            final = 0.0
        else:
            phases.append(CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=min_lr_ratio * peak))
            final = min_lr_ratio
        # hold the final value past total_steps (a cosine would rise again)
        phases.append(ConstantLR(optimizer, factor=final, total_iters=_FOREVER))
        milestones.append(milestones[-1] + decay_steps if milestones else decay_steps)
    if len(phases) == 1:
        return phases[0]
    return SequentialLR(optimizer, phases, milestones=milestones)
