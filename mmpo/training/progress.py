"""``StepProgressBar``: one line per run, ``step k/max_steps`` with an ETA and a few metrics.

Lightning's default bar counts batches per epoch (``Epoch 0/-2`` for a ``max_steps`` run, where
``max_epochs`` is -1) and shows every ``prog_bar`` metric plus ``v_num``, which wraps over several
lines. mmpo runs are sized in optimizer steps, so this bar counts ``trainer.global_step`` against
the run's total (``max_steps``, or the estimated steps of an epoch-sized run) for the whole fit,
and shows at most ``max_metrics`` metrics, short numbers only.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


def format_metric(value: float) -> str:
    """A metric in at most 4 significant digits (``0.2731``, ``6.471``, ``1.2e-05``)."""
    return f"{value:.4g}"


def run_total_steps(trainer: "pl.Trainer") -> int | None:
    """The optimizer steps this fit runs to: ``max_steps`` when set, else Lightning's estimate (None if unbounded)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    estimated = trainer.estimated_stepping_batches
    return None if estimated is None or math.isinf(estimated) else int(estimated)


def step_description(step: int, total: int | None) -> str:
    """``step 3/400`` (``step 3`` when the total is unknown)."""
    return f"step {step}/{total}" if total is not None else f"step {step}"


def chosen_metrics(metrics: Mapping[str, Any], keys: Sequence[str] | None, max_metrics: int) -> dict[str, str]:
    """The metrics to show: ``keys`` in that order when given, else the first ``max_metrics`` numeric ones.

    ``v_num`` (the logger version) is never shown; values are formatted by :func:`format_metric`.
    """
    names = list(keys) if keys is not None else [k for k in metrics if k != "v_num"]
    shown: dict[str, str] = {}
    for name in names:
        value = metrics.get(name)
        if value is None:
            continue
        try:
            shown[name] = format_metric(float(value))
        except (TypeError, ValueError):
            continue
        if len(shown) == max_metrics:
            break
    return shown


class StepProgressBar(TQDMProgressBar):
    """A tqdm bar over the run's optimizer steps: ``step 12/400: |███  | [00:31<15:40, 2.6s/step, loss=6.47]``.

    Args:
        metrics: the ``prog_bar`` metric names to show, in order; default: the first ``max_metrics``
            ones the module logs with ``prog_bar=True``.
        max_metrics: at most this many metrics on the line (keeps it to one terminal line).
        refresh_rate: update the bar every this many batches.
    """

    STEP_BAR_FORMAT = "{desc}: |{bar:20}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, metrics: Sequence[str] | None = None, max_metrics: int = 4, refresh_rate: int = 1,
                 process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)
        self.metric_keys = list(metrics) if metrics is not None else None
        self.max_metrics = max_metrics
        self._total: int | None = None

    def description(self, trainer: "pl.Trainer") -> str:
        """The bar's text before the bar: ``step <global_step>/<total>`` (total known from the fit's start)."""
        return step_description(trainer.global_step, self._total)

    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        return chosen_metrics(trainer.progress_bar_metrics, self.metric_keys, self.max_metrics)

    def init_train_tqdm(self) -> Tqdm:
        """The step bar, created knowing its total and start so that its first line is already right."""
        trainer = self.trainer
        return Tqdm(
            desc=self.description(trainer), total=self._total, initial=trainer.global_step,
            position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
            file=sys.stdout, smoothing=0, unit="step", bar_format=self.STEP_BAR_FORMAT,
        )

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # one bar for the whole fit; a resumed run starts at its restored step
        self._total = run_total_steps(trainer)
        self.train_progress_bar = self.init_train_tqdm()

    def on_train_epoch_start(self, trainer: "pl.Trainer", *_: Any) -> None:
        """Epochs do not restart the bar: it counts steps over the whole fit."""

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        step = trainer.global_step
        if (batch_idx + 1) % self.refresh_rate == 0 or step == self._total:
            bar.n = step  # several optimizer steps per batch (GRPO minibatches) advance it by more than one
            bar.set_description_str(self.description(trainer), refresh=False)
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
