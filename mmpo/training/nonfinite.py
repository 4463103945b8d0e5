"""Non-finite guard: a NaN/inf loss or gradient norm never reaches the weights.

One rule for every family (VLM GRPO/SFT, dLLM RL/SFT, robotics BC/DPPO):

- After backward, before the optimizer step, the loss and the total gradient norm (before
  clipping) are checked; under fp16 AMP only the loss (the GradScaler skips overflowing
  gradients itself). If either is NaN or inf, every gradient is dropped (set to None), so the
  following ``optimizer.step()`` changes nothing: torch optimizers skip parameters without a
  gradient, so weights, AdamW moments and AdamW's step count stay bit-identical.
- The skipped step still counts as a step: ``trainer.global_step`` and the LR schedule advance,
  so the schedule, the per-step seeds, ``max_steps`` and resume stay functions of the step count.
- Skips are counted (``perf/skipped_steps``, cumulative, logged) and each one is logged as a
  warning naming the step and the non-finite value(s).
- ``max_consecutive_skips`` skips in a row raise :class:`NonFiniteTrainingError`: ``trainer.fit``
  stops with it (``mmpo fit`` exits non-zero), Lightning's end-of-training hooks do not run, so no
  export is written at the end, and the checkpoints already written (all of finite weights) stay.
- The counters are saved in every checkpoint (a callback's state) and restored on resume.

Modules mix in :class:`NonFiniteGuardMixin` (before ``LightningModule``) and set
``self.nonfinite = NonFiniteGuard(max_consecutive_skips)`` in ``__init__``. Automatic
optimisation is guarded by the mixin's ``optimizer_step``; manual optimisation calls
:meth:`NonFiniteGuardMixin.nonfinite_step_ok` between backward and ``optimizer.step()``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

log = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_SKIPS = 10


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def gradient_norm(parameters: Iterable[Tensor]) -> Tensor:
    """Total L2 norm of the gradients of ``parameters`` (0 when none has a gradient)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    # FSDP2 gradients are DTensor shards: the norm over every rank's shard
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _as_float(value: Tensor | float | None) -> float | None:
    if value is None:
        return None
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm.

    Args:
        max_consecutive_skips: this many skipped steps in a row stop the run (>= 1).
    """

    def __init__(self, max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS) -> None:
        if int(max_consecutive_skips) < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_finite_step: int | None = None

    @property
    def skipping(self) -> bool:
        """True when the most recent checked step was skipped."""
        return self.consecutive_skips > 0

    def check(
        self,
        step: int,
        loss: Tensor | float | None,
        grad_norm: Tensor | float | None,
        *,
        reduce: Callable[[bool], bool] | None = None,
    ) -> bool:
        """True when the step may update the weights; False when it must be skipped.

        ``reduce`` turns this process's "non-finite" decision into one shared by every
        data-parallel rank (any rank non-finite -> all skip), so ranks never diverge.
        Raises :class:`NonFiniteTrainingError` at ``max_consecutive_skips`` skips in a row.
        """
        values = {"loss": _as_float(loss), "gradient norm": _as_float(grad_norm)}
        bad = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
        skip = bool(bad)
        if reduce is not None:
            skip = bool(reduce(skip))
        if not skip:
            self.consecutive_skips = 0
            self.last_finite_step = int(step)
            return True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        what = " and ".join(f"{name} {values[name]}" for name in bad) or "a value on another rank"
        log.warning(
            "step %d: non-finite %s; optimizer step skipped, weights and optimizer state unchanged "
            "(%d in a row, %d skipped in total)", step, what, self.consecutive_skips, self.skipped_steps,
        )
        if self.consecutive_skips >= self.max_consecutive_skips:
            last = "none (no step of this run was finite)" if self.last_finite_step is None else str(self.last_finite_step)
            raise NonFiniteTrainingError(
                f"training stopped: {self.consecutive_skips} consecutive optimizer steps (up to step {step}) had a "
                f"non-finite loss or gradient norm (last: {what}); max_consecutive_skips={self.max_consecutive_skips}. "
                f"Last finite step: {last}. The weights were never updated with non-finite values; the last "
                f"checkpoint is kept and no end-of-training export was written. Check the data, rewards and "
                f"learning rate, then resume from the last checkpoint."
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "last_finite_step": self.last_finite_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        last = state.get("last_finite_step")
        self.last_finite_step = None if last is None else int(last)


class NonFiniteGuardState(Callback):
    """Saves the module's :class:`NonFiniteGuard` counters in checkpoints and restores them on resume."""

    def __init__(self, guard: NonFiniteGuard) -> None:
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.guard.load_state_dict(state_dict)


class NonFiniteGuardMixin:
    """LightningModule mixin (list it before ``LightningModule``); needs ``self.nonfinite``."""

    nonfinite: NonFiniteGuard

    def configure_callbacks(self):  # type: ignore[no-untyped-def]
        inherited = super().configure_callbacks()  # type: ignore[misc]
        inherited = [inherited] if isinstance(inherited, Callback) else list(inherited)
        return [*inherited, NonFiniteGuardState(self.nonfinite)]

    def nonfinite_step_ok(
        self, loss: Tensor | float | None, grad_norm: Tensor | float | None, *optimizers: Any
    ) -> bool:
        """Check this step (call after backward, before ``optimizer.step()``); on a skip the
        gradients of ``optimizers`` are dropped so their ``step()`` is a no-op."""
        trainer = getattr(self, "_trainer", None)
        step = trainer.global_step if trainer is not None else 0
        reduce = None
        if trainer is not None:
            reduce = lambda decision: trainer.strategy.reduce_boolean_decision(decision, all=False)  # noqa: E731
            if getattr(trainer.precision_plugin, "scaler", None) is not None:
                # fp16 AMP: gradients are still scaled here and an overflow is the GradScaler's to skip
                # (it lowers the scale); dropping them would hide the overflow from it
                grad_norm = None
        ok = self.nonfinite.check(step, loss, grad_norm, reduce=reduce)
        if not ok:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        return ok

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Automatic optimisation: the closure (training_step + backward) runs inside
        ``optimizer.step``; the guard checks its loss and gradients before the update."""

        def guarded_closure() -> Any:
            loss = optimizer_closure()
            if loss is not None:  # None: training_step skipped the batch itself
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self.nonfinite_step_ok(loss, gradient_norm(params), optimizer)
            return loss

        optimizer.step(closure=guarded_closure)
        self.log("perf/skipped_steps", float(self.nonfinite.skipped_steps), on_step=True, on_epoch=False)  # type: ignore[attr-defined]
