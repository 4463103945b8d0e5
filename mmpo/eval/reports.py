"""Eval reports: ``results.json`` and markdown tables.

The results dict (what ``mmpo.eval.harness.evaluate_checkpoint`` returns and
``results.json`` holds)::

    {
      "model": str, "model_type": "vlm" | "dllm",
      "data_dir": str,   # only when named benchmarks were read from --data-dir
      "decoding": {"greedy": bool, "temperature": float, "num_samples": int, ...},
      "benchmarks": {
        name: {"num_items": int, "num_samples": int, "accuracy": float,
               "avg@k": float, "pass@1": float, ..., "pass@k": float,
               "by_task": {task: {same metric keys}}, "seconds": float,
               "judge": {"protocol": str, "items": float, "rule_accuracy": float, "judge_accuracy": float,
                         "agreement": float, "judge_failed": float}},   # judge-scored benchmarks only
      },
      "judge": {"url" | "path" | "backend": str, "model": str, ..., "benchmarks": [name, ...]},   # with --judge
    }
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping


def write_json(results: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``results`` as indented JSON (NaN written as null); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(results), indent=2, sort_keys=False) + "\n")
    return path


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def metric_columns(benchmark_metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The avg@k / pass@k column names present in any benchmark, in k order."""
    names: list[str] = []
    for metrics in benchmark_metrics.values():
        for key in metrics:
            if (key.startswith("avg@") or key.startswith("pass@")) and key not in names:
                names.append(key)
    return sorted(names, key=lambda key: (not key.startswith("avg@"), int(key.split("@")[1])))


def _format_number(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table; floats printed with 3 decimals, None/NaN as ``n/a``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([" --- "] * len(header)) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_format_number(cell) for cell in row) + " |")
    return "\n".join(lines)


TOOL_COLUMNS = ("tool_call_rate", "tool_calls_per_answer", "turns_per_answer")
"""Columns of a run with tools (``mmpo eval --tools``)."""


JUDGE_COLUMNS = ("judge_accuracy", "agreement", "judge_failed")
"""Columns of judge-scored benchmarks (``mmpo eval --judge``; ``agreement``: judge score equal to the rule's)."""


def results_table(results: Mapping[str, Any]) -> str:
    """Markdown table of one eval run: a row per benchmark (and per task inside multi-task ones)."""
    benchmarks: Mapping[str, Mapping[str, Any]] = results["benchmarks"]
    columns = metric_columns(benchmarks)
    # runs with tools (`mmpo eval --tools`) add how the answers used them
    tool_columns = [key for key in TOOL_COLUMNS if any(key in metrics for metrics in benchmarks.values())]
    judge_columns = list(JUDGE_COLUMNS) if any("judge" in metrics for metrics in benchmarks.values()) else []
    header = ["benchmark", "items", "samples", "accuracy", *columns, *tool_columns, *judge_columns]
    rows: list[list[Any]] = []
    for name, metrics in benchmarks.items():
        judged = metrics.get("judge") or {}
        rows.append([name, metrics["num_items"], metrics["num_samples"], metrics["accuracy"],
                     *[metrics.get(column) for column in [*columns, *tool_columns]],
                     *[judged.get(column) for column in judge_columns]])
        by_task = metrics.get("by_task") or {}
        if len(by_task) > 1:
            for task, task_metrics in by_task.items():
                rows.append([f"  {name}:{task}", task_metrics["num_items"], task_metrics["num_samples"],
                             task_metrics["accuracy"], *[task_metrics.get(column) for column in columns],
                             *[None for _ in [*tool_columns, *judge_columns]]])
    return markdown_table(header, rows)


def results_markdown(results: Mapping[str, Any]) -> str:
    """The full ``results.md``: model, decoding settings and the table."""
    decoding = results.get("decoding", {})
    settings = ", ".join(f"{key}={value}" for key, value in decoding.items())
    tools = results.get("tool_use")
    with_tools = ("With tools: " + ", ".join(f"{key}={value}" for key, value in tools.items()) + ".\n\n") if tools else ""
    judge = results.get("judge")
    with_judge = ("Judge-scored (accuracy: the rule's; judge_accuracy, agreement: the judge's): "
                  + ", ".join(f"{key}={value}" for key, value in judge.items() if value is not None) + ".\n\n"
                  ) if judge else ""
    return (
        f"# Eval: {results.get('model', '?')}\n\n"
        f"Model type: {results.get('model_type', '?')}. Decoding: {settings}.\n\n"
        f"{with_tools}{with_judge}{results_table(results)}\n"
    )


def comparison_table(columns: Mapping[str, Mapping[str, float]], *, row_label: str = "task") -> str:
    """Markdown table with one column per series (e.g. before SFT / after SFT / after GRPO).

    Args:
        columns: {series name: {row name: value}}; missing cells print ``n/a``.
    """
    row_names: list[str] = []
    for values in columns.values():
        row_names += [name for name in values if name not in row_names]
    rows = [[name, *[values.get(name) for values in columns.values()]] for name in row_names]
    return markdown_table([row_label, *columns], rows)
