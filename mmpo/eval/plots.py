"""Plots: accuracy bars per benchmark (one bar per series) and training curves from Lightning's CSV logger."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from mmpo.files import atomic_outputs  # noqa: E402


def plot_accuracy_bars(
    series: Mapping[str, Mapping[str, float]],
    path: str | Path,
    *,
    title: str = "Accuracy per benchmark",
    ylabel: str = "accuracy",
) -> Path:
    """Grouped bar chart: x = benchmark (or task), one bar per series, values in [0, 1].

    Args:
        series: {series name (e.g. "after GRPO"): {benchmark: accuracy}}.
        path: output image (``.png``).
    """
    if not series:
        raise ValueError("plot_accuracy_bars needs at least one series")
    categories: list[str] = []
    for values in series.values():
        categories += [name for name in values if name not in categories]
    width = 0.8 / len(series)
    figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(categories) * max(1, len(series)) ** 0.5 + 2), 4))
    for index, (label, values) in enumerate(series.items()):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(categories))]
        heights = [_finite_or_zero(values.get(name)) for name in categories]
        bars = axes.bar(positions, heights, width=width, label=label)
        axes.bar_label(bars, labels=[f"{h:.2f}" for h in heights], fontsize=7, padding=1)
    axes.set_xticks(range(len(categories)))
    axes.set_xticklabels(categories, rotation=20, ha="right", fontsize=8)
    axes.set_ylim(0, 1.08)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    if len(series) > 1:
        axes.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _finite_or_zero(value: float | None) -> float:
    return float(value) if value is not None and math.isfinite(float(value)) else 0.0


def _read_one_csv(metrics_csv: str | Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(metrics_csv, newline="") as handle:
        for record in csv.DictReader(handle):
            step_text = record.get("step", "")
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in record.items():
                if key in ("step", "epoch") or text in ("", None):
                    continue
                curves.setdefault(key, []).append((step, float(text)))
    return curves


def read_csv_metrics(
    metrics_csv: str | Path | Sequence[str | Path],
) -> dict[str, list[tuple[int, float]]]:
    """Lightning ``CSVLogger`` ``metrics.csv`` -> {metric: [(step, value), ...]} (empty cells skipped).

    A sequence of files is one run and its resumptions, in order (each resume logs to a new
    version): a later file's rows replace the earlier files' rows from its first step on, since
    the steps logged after the resumed checkpoint were done again.
    """
    files = [metrics_csv] if isinstance(metrics_csv, (str, Path)) else list(metrics_csv)
    merged: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        curves = _read_one_csv(path)
        steps = [step for points in curves.values() for step, _ in points]
        if not steps:
            continue
        first = min(steps)
        merged = {key: [(s, v) for s, v in points if s < first] for key, points in merged.items()}
        for key, points in curves.items():
            merged.setdefault(key, []).extend(points)
    return {key: points for key, points in merged.items() if points}


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start); window 1 returns the values."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot_curves(
    metrics_csv: str | Path | Sequence[str | Path],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str = "Training curve",
    smooth_window: int = 10,
    references: Mapping[str, tuple[str, float]] | None = None,
) -> Path:
    """One subplot per metric in ``keys`` (those present in the CSV), value against step.

    ``metrics_csv`` may be a run's CSVs across resumptions (see ``read_csv_metrics``).

    Args:
        smooth_window: also draw a trailing moving average over this many points (noisy RL
            rewards); ignored for curves with fewer points.
        references: {key: (label, value)} horizontal lines, e.g. the accuracy before RL.

    Raises:
        ValueError: when none of ``keys`` is in the CSV (naming the ones that are).
    """
    curves = read_csv_metrics(metrics_csv)
    present = [key for key in keys if curves.get(key)]
    if not present:
        raise ValueError(f"none of {list(keys)} logged in {metrics_csv}; logged: {sorted(curves)}")
    return plot_curve_grid(curves, present, path, title=title, smooth_window=smooth_window, references=references,
                           ncols=len(present))


def plot_curve_grid(
    curves: Mapping[str, Sequence[tuple[int, float]]],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str,
    smooth_window: int = 10,
    references: Mapping[str, tuple[str, float]] | None = None,
    ncols: int = 3,
) -> Path:
    """One subplot per metric of ``keys`` (each must have points in ``curves``: {metric: [(step, value)]}),
    ``ncols`` to a row, value against step; written to ``path`` (PNG). See :func:`plot_curves` for the rest."""
    ncols = max(1, min(ncols, len(keys)))
    nrows = math.ceil(len(keys) / ncols)
    figure, axes_grid = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for axes, key in zip(axes_grid.flat, keys):
        steps, values = zip(*curves[key])
        smoothing = len(values) > smooth_window > 1
        axes.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                  alpha=0.35 if smoothing else 1.0, label="per step" if smoothing else None)
        if smoothing:
            axes.plot(steps, moving_average(values, smooth_window), label=f"mean of last {smooth_window}")
        if references and key in references:
            label, value = references[key]
            axes.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
        if smoothing or (references and key in references):
            axes.legend(fontsize=7)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers: no 0.5 ticks
        axes.set_title(key, fontsize=9)
        axes.grid(alpha=0.3)
    for axes in list(axes_grid.flat)[len(keys):]:
        axes.set_visible(False)
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    with atomic_outputs(path) as (temp,):  # a reader never sees half a PNG
        figure.savefig(temp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(figure)
    return path
