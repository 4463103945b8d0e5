"""``mmpo report RUN_DIR``: plots of a run's logged metrics and a short Markdown summary.

Reads the run's own logs: every Lightning ``CSVLogger`` ``metrics.csv`` under ``RUN_DIR`` (a run and its
resumptions, oldest first: :func:`mmpo.eval.plots.read_csv_metrics`), or, when there is none, the
``TensorBoardLogger`` event files (Lightning's default logger; the dLLM configs use it). Works for any
family: it plots whatever the run logged.

Writes, under ``RUN_DIR/report`` (or ``--out``):

- ``<group>.png``: one figure per metric group, the part of the name before the first ``/``
  (``rewards``, ``losses``, ``policy``, ``response``, ``perf``, ``val`` ...; names without a ``/`` such as
  ``kl``, ``entropy``, ``lr`` form the group ``metrics``), one panel per metric, value against step;
- ``summary.md``: the log it read, how many steps were logged and the last step, and first / last / best
  of the key metrics (:data:`KEY_METRICS` that the run logged, and every ``val/`` metric).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mmpo.files import atomic_write_text

Curves = dict[str, list[tuple[int, float]]]

# the shared metric vocabulary's headline names (docs/core.md, "Metric names"), in summary order
KEY_METRICS: tuple[str, ...] = (
    "rewards/total/mean", "val/accuracy", "losses/policy", "losses/sft", "losses/bc", "losses/value",
    "kl", "policy/approx_kl", "entropy", "policy/clipfrac", "response/length_mean", "perf/tokens_per_s",
    "perf/env_steps_per_s",
)
OTHER_GROUP = "metrics"
NOT_METRICS = frozenset({"epoch", "step", "hp_metric"})


@dataclass(frozen=True)
class MetricSummary:
    name: str
    first: float
    last: float
    best: float | None  # None: the metric has no better direction
    best_step: int | None


@dataclass(frozen=True)
class RunLogs:
    source: str  # "csv" or "tensorboard"
    files: list[Path]
    curves: Curves


class NoLogsError(FileNotFoundError):
    """RUN_DIR holds neither a metrics.csv nor a TensorBoard event file."""


def find_logs(run_dir: Path) -> RunLogs:
    """The run's metric curves: its ``metrics.csv`` files (oldest first), else its TensorBoard event files."""
    if not run_dir.is_dir():
        raise NoLogsError(f"{run_dir} is not a directory")
    csvs = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if csvs:
        from mmpo.eval.plots import read_csv_metrics

        return RunLogs("csv", csvs, _metrics_only(read_csv_metrics(csvs)))
    events = sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if events:
        return RunLogs("tensorboard", events, _metrics_only(read_tensorboard_scalars(events)))
    raise NoLogsError(f"no metrics.csv or TensorBoard event file under {run_dir} (was the run's logger disabled?)")


def _metrics_only(curves: Curves) -> Curves:
    return {name: points for name, points in curves.items() if name not in NOT_METRICS and points}


def read_tensorboard_scalars(event_files: Sequence[Path]) -> Curves:
    """{tag: [(step, value), ...]} of every scalar in the event files (files in order; a later file's points
    replace the earlier ones' from its first step on, as for resumed CSV logs)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    merged: Curves = {}
    for path in event_files:
        accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0})
        accumulator.Reload()
        curves = {tag: [(int(e.step), float(e.value)) for e in accumulator.Scalars(tag)]
                  for tag in accumulator.Tags()["scalars"]}
        steps = [step for points in curves.values() for step, _ in points]
        if not steps:
            continue
        first = min(steps)
        merged = {key: [(s, v) for s, v in points if s < first] for key, points in merged.items()}
        for key, points in curves.items():
            merged.setdefault(key, []).extend(points)
    return merged


def metric_group(name: str) -> str:
    """``rewards/total/mean`` -> ``rewards``; a name without ``/`` -> ``metrics``."""
    return name.split("/", 1)[0] if "/" in name else OTHER_GROUP


def better_direction(name: str) -> str | None:
    """``"max"`` for rewards, accuracies, success rates and returns, ``"min"`` for losses, else None."""
    lowered = name.lower()
    if any(word in lowered for word in ("reward", "accuracy", "success", "return")):
        return "max"
    if lowered.startswith("losses/") or lowered.split("/")[-1] == "loss":
        return "min"
    return None


def summarise(name: str, points: Sequence[tuple[int, float]]) -> MetricSummary:
    """First, last and (with a direction) best finite value of a curve, in logged order."""
    finite = [(step, value) for step, value in points if math.isfinite(value)]
    if not finite:
        return MetricSummary(name, math.nan, math.nan, None, None)
    direction = better_direction(name)
    best_step, best = (None, None)
    if direction is not None:
        pick = max if direction == "max" else min
        best_step, best = pick(finite, key=lambda point: point[1])  # first occurrence of the best value
    return MetricSummary(name, finite[0][1], finite[-1][1], best, best_step)


def key_metrics(curves: Curves) -> list[str]:
    """:data:`KEY_METRICS` the run logged (with Lightning's ``_step`` / ``_epoch`` suffixes of a metric logged
    both ways), then every ``val/`` metric."""
    names = [variant for name in KEY_METRICS for variant in (name, f"{name}_step", f"{name}_epoch")
             if variant in curves]
    return names + sorted(n for n in curves if n.startswith("val/") and n not in names)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def summary_markdown(run_dir: Path, logs: RunLogs, plots: Sequence[Path]) -> str:
    steps = sorted({step for points in logs.curves.values() for step, _ in points})
    lines = [
        f"# Run report: {run_dir}",
        "",
        f"- logs: {', '.join(str(p.relative_to(run_dir)) for p in logs.files)} ({logs.source})",
        f"- steps logged: {len(steps)}; last step: {steps[-1] if steps else 'none'}",
        f"- metrics: {len(logs.curves)}, plotted in {', '.join(p.name for p in plots)}",
        "",
        "| metric | first | last | best | best at step |",
        "|---|---|---|---|---|",
    ]
    for name in key_metrics(logs.curves):
        s = summarise(name, logs.curves[name])
        lines.append(f"| {name} | {_number(s.first)} | {_number(s.last)} | {_number(s.best)} | "
                     f"{'' if s.best_step is None else s.best_step} |")
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, out: str | Path | None = None, *, ncols: int = 3) -> tuple[list[Path], Path]:
    """Write the group plots and ``summary.md``; returns (plot paths, summary path)."""
    from mmpo.eval.plots import plot_curve_grid

    run_dir = Path(run_dir)
    out = run_dir / "report" if out is None else Path(out)
    logs = find_logs(run_dir)
    groups: dict[str, list[str]] = {}
    for name in sorted(logs.curves):
        groups.setdefault(metric_group(name), []).append(name)
    plots = [plot_curve_grid(logs.curves, names, out / f"{group}.png", title=f"{group} ({run_dir.name})",
                             ncols=ncols)
             for group, names in groups.items()]
    summary = atomic_write_text(out / "summary.md", summary_markdown(run_dir, logs, plots))
    return plots, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmpo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's log directory (trainer.default_root_dir or the logger's save_dir)")
    parser.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        plots, summary = write_report(args.run_dir, args.out)
    except NoLogsError as error:
        print(f"mmpo report: error: {error}", file=sys.stderr)
        return 2
    print(summary.read_text())
    print(f"plots: {', '.join(str(p) for p in plots)}")
    return 0
