"""Per-step diagnostics written with Lightning's logger call, without a ``self.log`` per key.

``LightningModule.log`` costs a few hundred microseconds per key on a CPU (a tensor per value, a
torchmetrics ``_ResultMetric`` per key moved and updated, signature inspection), so a GRPO step's ~30
diagnostics cost several milliseconds whenever they are logged (``bench/bench_logging_cost.py``). Keys that
nothing reads between logger writes (no callback monitors them, no progress bar shows them) need none of
that: :func:`log_with_step_metrics` queues them, and they are merged into the dict Lightning's
``LoggerConnector.log_metrics`` passes to every logger for this step, in one call, as float32 values (what
``self.log`` of a Python float gives). The loggers receive the same dict, with the same keys, values, key
order and step, as when every key went through ``self.log``; ``trainer.logged_metrics`` holds them too.
They are not in ``trainer.callback_metrics`` (read ``module.last_metrics`` for them).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

_PATCHED = "_mmpo_step_metrics_merge"


def log_with_step_metrics(module: Any, metrics: Mapping[str, float], order: Sequence[str]) -> None:
    """Queue ``metrics`` for the trainer's logger write of this training step.

    ``order``: every key of the step in the order ``self.log`` would have met them first (the loggers'
    column order, e.g. ``metrics.csv``'s, follows it). Call it only on steps Lightning writes to its loggers."""
    connector = module.trainer._logger_connector
    if not getattr(connector, _PATCHED, False):
        _install(connector)
    # float32 as self.log stores a float (torch.tensor(value, dtype=float32)); one tensor for all values
    values = torch.tensor(list(metrics.values()), dtype=torch.float32).tolist() if metrics else []
    connector._mmpo_pending = (dict(zip(metrics, values)), list(order))


def _install(connector: Any) -> None:
    original = connector.log_metrics

    def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
        pending = getattr(connector, "_mmpo_pending", None)
        connector._mmpo_pending = None
        if pending and pending[0]:
            extra, order = pending
            merged = {**metrics, **extra}
            ranked = {key: index for index, key in enumerate(order)}
            # the step's keys in their logging order; Lightning's others (none during training) after them
            metrics = dict(sorted(merged.items(), key=lambda item: ranked.get(item[0], len(ranked))))
        original(metrics, step)

    connector.log_metrics = log_metrics
    connector._mmpo_pending = None
    setattr(connector, _PATCHED, True)
