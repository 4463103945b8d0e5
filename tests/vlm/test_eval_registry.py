"""Benchmark registry: synth/<task>, synth/all, file:<path>, registered names and their errors."""

import json

import pytest

from mmpo.data.synthetic import TASKS
from mmpo.eval import registry
from mmpo.eval.registry import (
    BENCHMARKS,
    UnknownBenchmarkError,
    available_benchmarks,
    load_benchmark_rows,
    register_benchmark,
    resolve_benchmark,
)


@pytest.fixture
def clean_registry():
    saved = dict(BENCHMARKS)
    yield
    BENCHMARKS.clear()
    BENCHMARKS.update(saved)


def test_synth_task_is_the_test_split():
    task = TASKS[0]
    rows = load_benchmark_rows(resolve_benchmark(f"synth/{task}", synth_size=3, synth_seed=5))
    assert len(rows) == 3
    assert all(row["task"] == task and "-test-" in row["id"] for row in rows)
    # deterministic by seed
    again = load_benchmark_rows(resolve_benchmark(f"synth/{task}", synth_size=3, synth_seed=5))
    assert [row["id"] for row in again] == [row["id"] for row in rows]


def test_synth_val_split_is_disjoint_from_the_test_split():
    """synth_split="val": the validation items (to choose settings on), none of them a test item; a bad split is
    refused when the name is resolved, before anything loads."""
    from mmpo.data.synthetic import make_items

    val = load_benchmark_rows(resolve_benchmark("synth/calc", synth_size=20, synth_seed=5, synth_split="val"))
    test = load_benchmark_rows(resolve_benchmark("synth/calc", synth_size=20, synth_seed=5))
    assert [row["id"] for row in val] == [f"calc-val-s5-{i}" for i in range(20)]
    assert [row["problem"] for row in val] == [row["problem"] for row in make_items("calc", 20, seed=5, split="val")]
    assert not {row["problem"] for row in val} & {row["problem"] for row in test}
    with pytest.raises(ValueError, match="synth_split must be 'test' or 'val', got 'train'"):
        resolve_benchmark("synth/calc", synth_split="train")


def test_synth_all_interleaves_tasks_so_limit_keeps_a_mix():
    rows = load_benchmark_rows(resolve_benchmark("synth/all", synth_size=2), limit=len(TASKS))
    assert [row["task"] for row in rows] == list(TASKS)
    assert len(load_benchmark_rows(resolve_benchmark("synth/all", synth_size=2))) == 2 * len(TASKS)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(UnknownBenchmarkError) as error:
        resolve_benchmark("no-such-bench")
    message = str(error.value)
    assert "no-such-bench" in message and "synth/all" in message and f"synth/{TASKS[0]}" in message
    with pytest.raises(UnknownBenchmarkError, match="unknown synthetic task 'nope'.*synth/all"):
        resolve_benchmark("synth/nope")
    assert "file:<path>" in available_benchmarks()


def test_file_benchmark_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        resolve_benchmark(f"file:{tmp_path / 'missing.jsonl'}")


def test_file_benchmark_reads_jsonl(tmp_path):
    path = tmp_path / "items.jsonl"
    items = [{"problem": "What is 2 + 3?", "answer": "5"}, {"problem": "What is 4 - 1?", "answer": "3"}]
    path.write_text("\n".join(json.dumps(item) for item in items) + "\n")
    rows = load_benchmark_rows(resolve_benchmark(f"file:{path}"))
    assert [row["answer"] for row in rows] == ["5", "3"]
    assert [row["problem"] for row in rows] == ["What is 2 + 3?", "What is 4 - 1?"]


def test_register_and_resolve(clean_registry):
    rows = [{"id": "t0", "task": "toy", "images": [], "problem": "1+1?", "answer": "2"}]
    benchmark = register_benchmark("toy/text", lambda: rows, modality="dllm")
    assert resolve_benchmark("toy/text") is benchmark
    assert "toy/text" in available_benchmarks()
    assert load_benchmark_rows(benchmark) == rows


def test_register_errors(clean_registry):
    register_benchmark("toy/a", lambda: [])
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark("toy/a", lambda: [])
    register_benchmark("toy/a", lambda: [{"id": "x"}], overwrite=True)
    with pytest.raises(ValueError, match="modality"):
        register_benchmark("toy/b", lambda: [], modality="audio")
    with pytest.raises(ValueError, match="reserved"):
        register_benchmark("synth/mine", lambda: [])
    with pytest.raises(TypeError, match="callable"):
        register_benchmark("toy/c", [1, 2])
    with pytest.raises(ValueError, match="'toy/empty' loaded no rows"):
        load_benchmark_rows(register_benchmark("toy/empty", lambda: []))
    with pytest.raises(ValueError, match="limit"):
        load_benchmark_rows(resolve_benchmark("toy/a"), limit=0)


def test_plugin_modules_are_imported(clean_registry, monkeypatch, tmp_path):
    # A plugin module registers its benchmarks on import (how mmpo.dllm.eval adds its text suites).
    (tmp_path / "fake_bench_plugin.py").write_text(
        "from mmpo.eval.registry import register_benchmark\n"
        "register_benchmark('plugin/toy', lambda: [{'id': 'p0'}], modality='dllm')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "PLUGIN_MODULES", ("fake_bench_plugin", "absent_plugin_module"))
    assert resolve_benchmark("plugin/toy").modality == "dllm"
