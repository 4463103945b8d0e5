"""Report writers: results.json, markdown tables, accuracy bars, CSV-logger curves."""

import json

import pytest

from mmpo.eval.harness import write_reports
from mmpo.eval.plots import moving_average, plot_accuracy_bars, plot_curves, read_csv_metrics
from mmpo.eval.reports import comparison_table, markdown_table, metric_columns, results_table, write_json

RESULTS = {
    "model": "/tmp/some/model",
    "model_type": "vlm",
    "decoding": {"greedy": False, "temperature": 1.0, "num_samples": 2},
    "benchmarks": {
        "synth/all": {
            "num_items": 4, "num_samples": 2, "accuracy": 0.5, "avg@2": 0.5, "pass@1": 0.5, "pass@2": 0.75,
            "by_task": {
                "count_shapes": {"num_items": 2, "num_samples": 2, "accuracy": 0.25, "avg@2": 0.25,
                                 "pass@1": 0.25, "pass@2": 0.5},
                "bar_chart": {"num_items": 2, "num_samples": 2, "accuracy": 0.75, "avg@2": 0.75,
                              "pass@1": 0.75, "pass@2": 1.0},
            },
        },
        "file:x.jsonl": {"num_items": 3, "num_samples": 2, "accuracy": 0.0, "avg@2": 0.0, "pass@1": 0.0,
                         "pass@2": float("nan"), "by_task": {}},
    },
}


def test_metric_columns_sorted_by_k():
    assert metric_columns({"a": {"pass@2": 1, "pass@1": 1, "avg@2": 1, "accuracy": 1, "pass@16": 1}}) == [
        "avg@2", "pass@1", "pass@2", "pass@16"]


def test_markdown_table_formats_cells():
    table = markdown_table(["name", "value"], [["a", 0.12345], ["b", None], ["c", float("nan")], ["d", 3]])
    assert table.splitlines() == [
        "| name | value |",
        "| --- | --- |",
        "| a | 0.123 |",
        "| b | n/a |",
        "| c | n/a |",
        "| d | 3 |",
    ]


def test_results_table_has_a_row_per_benchmark_and_task():
    lines = results_table(RESULTS).splitlines()
    assert lines[0] == "| benchmark | items | samples | accuracy | avg@2 | pass@1 | pass@2 |"
    assert lines[2] == "| synth/all | 4 | 2 | 0.500 | 0.500 | 0.500 | 0.750 |"
    assert lines[3] == "|   synth/all:count_shapes | 2 | 2 | 0.250 | 0.250 | 0.250 | 0.500 |"
    assert lines[5] == "| file:x.jsonl | 3 | 2 | 0.000 | 0.000 | 0.000 | n/a |"


def test_comparison_table_fills_missing_cells():
    table = comparison_table({"before": {"a": 0.1, "b": 0.2}, "after": {"a": 0.5}})
    assert table.splitlines()[2:] == ["| a | 0.100 | 0.500 |", "| b | 0.200 | n/a |"]


def test_write_json_nan_becomes_null(tmp_path):
    path = write_json(RESULTS, tmp_path / "sub" / "results.json")
    loaded = json.loads(path.read_text())
    assert loaded["benchmarks"]["file:x.jsonl"]["pass@2"] is None
    assert loaded["benchmarks"]["synth/all"]["pass@2"] == 0.75


def test_write_reports_writes_all_files(tmp_path):
    predictions = {"synth/all": [{"id": "a", "completions": ["x"], "correct": [True]}]}
    paths = write_reports(RESULTS, tmp_path, predictions=predictions)
    assert json.loads((tmp_path / "results.json").read_text())["model_type"] == "vlm"
    assert "| synth/all | 4 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["predictions/synth/all"].read_text().splitlines()[0])["id"] == "a"
    assert paths["predictions/synth/all"].name == "synth_all.jsonl"


def test_plot_accuracy_bars_rejects_empty(tmp_path):
    with pytest.raises(ValueError):
        plot_accuracy_bars({}, tmp_path / "x.png")


def test_csv_curves(tmp_path):
    # The layout Lightning's CSVLogger writes: one row per log call, blanks elsewhere.
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("epoch,rewards/total/mean,step,val/accuracy\n"
                        "0,0.25,0,\n"
                        "0,0.5,1,\n"
                        "0,,1,0.4\n"
                        "0,0.75,2,\n")
    curves = read_csv_metrics(csv_path)
    assert curves["rewards/total/mean"] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert curves["val/accuracy"] == [(1, 0.4)]
    out = plot_curves(csv_path, ["rewards/total/mean", "val/accuracy", "not/logged"], tmp_path / "curve.png",
                      smooth_window=2, references={"val/accuracy": ("before RL", 0.3)})
    assert out.stat().st_size > 1000
    with pytest.raises(ValueError, match="not/logged"):
        plot_curves(csv_path, ["not/logged"], tmp_path / "none.png")


def test_moving_average_hand_computed():
    # window 2: [1], [1, 3], [3, 5], [5, 7] -> 1, 2, 4, 6
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([1.0, 3.0], 1) == [1.0, 3.0]
    with pytest.raises(ValueError):
        moving_average([1.0], 0)
