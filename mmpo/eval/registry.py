"""Benchmark registry: a name -> a loader of rows (the contract's Row dicts).

Four kinds of names resolve here:

* registered names (``register_benchmark``), e.g. the dLLM agent's text suites;
* local-file benchmarks (``register_local_benchmark``; ``mmpo.eval.benchmarks``: MathVista,
  MathVerse, MathVision, Geometry3K, GeoQA, ChartQA, MMMU, GSM8K, MATH-500) read from the
  publisher's files under a data folder (``mmpo eval --data-dir DIR``);
* ``synth/<task>`` (the held-out test split of one synthetic task),
  ``synth/all`` (every task) and ``synth/text`` (the text-LM tasks, ``TEXT_TASKS``), generated on the fly from
  ``mmpo.data.synthetic`` so tasks added later with ``register_task`` appear too;
* ``file:<path>`` for a local dataset read by ``mmpo.data.loaders.load_rows``.

An unknown name fails with a message listing the valid ones (verl-style
registries: no silent fallbacks).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

Row = dict[str, Any]

MODALITIES = ("vlm", "dllm")
SYNTH_PREFIX = "synth/"
FILE_PREFIX = "file:"
DEFAULT_SYNTH_SIZE = 50
DEFAULT_SYNTH_SEED = 1234

# Modules that register benchmarks when imported (owned by other agents).
# Imported lazily by `available_benchmarks` / `resolve_benchmark`.
PLUGIN_MODULES = ("mmpo.eval.benchmarks", "mmpo.dllm.eval")


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: a name, a zero-argument loader of rows and the model family it targets.

    ``scorer`` is an optional ``fn(completions, rows) -> Tensor (N,)`` reward in
    [0, 1]; ``None`` means the shared ``accuracy`` reward (math-verify). ``judge`` (local-file
    benchmarks) is ``fn(completion, row) -> (extracted answer, score)`` and replaces both;
    ``expects`` describes the files a local-file benchmark reads.
    """

    name: str
    loader: Callable[[], list[Row]]
    modality: str = "vlm"
    scorer: Callable[..., Any] | None = None
    description: str = ""
    judge: Callable[[str, Row], tuple[str | None, float]] | None = None
    expects: str = ""


class LocalFileBenchmark(Protocol):
    """What ``register_local_benchmark`` needs (``mmpo.eval.benchmarks.base.LocalBenchmark``)."""

    name: str
    modality: str
    description: str

    def expects(self) -> str: ...
    def check_files(self, data_dir: str | Path | None) -> None: ...
    def load(self, data_dir: str | Path) -> list[Row]: ...


BENCHMARKS: dict[str, Benchmark] = {}
LOCAL_BENCHMARKS: dict[str, LocalFileBenchmark] = {}


class UnknownBenchmarkError(KeyError):
    """A benchmark name that is neither registered, ``synth/<task>`` nor ``file:<path>``."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


def register_benchmark(
    name: str,
    loader: Callable[[], list[Row]],
    modality: str = "vlm",
    *,
    scorer: Callable[..., Any] | None = None,
    description: str = "",
    overwrite: bool = False,
) -> Benchmark:
    """Register ``loader`` under ``name``.

    Args:
        name: benchmark name (must not start with ``synth/`` or ``file:``, which are reserved).
        loader: called with no arguments, returns ``list[Row]``.
        modality: ``"vlm"`` (image+text rows for VLM checkpoints) or ``"dllm"`` (text rows
            for masked-diffusion LM checkpoints).
        scorer: optional ``fn(completions, rows) -> Tensor (N,)``; default: the accuracy reward.
        overwrite: allow replacing an existing registration (otherwise a duplicate name fails).

    Returns:
        The registered :class:`Benchmark`.
    """
    if modality not in MODALITIES:
        raise ValueError(f"benchmark {name!r}: modality must be one of {MODALITIES}, got {modality!r}")
    if name.startswith(SYNTH_PREFIX) or name.startswith(FILE_PREFIX):
        raise ValueError(f"benchmark {name!r}: names starting with {SYNTH_PREFIX!r} or {FILE_PREFIX!r} are reserved")
    if not callable(loader):
        raise TypeError(f"benchmark {name!r}: loader must be callable, got {type(loader).__name__}")
    if name in BENCHMARKS and not overwrite and BENCHMARKS[name].loader is not loader:
        raise ValueError(f"benchmark {name!r} is already registered (pass overwrite=True to replace it)")
    benchmark = Benchmark(name=name, loader=loader, modality=modality, scorer=scorer, description=description)
    BENCHMARKS[name] = benchmark
    return benchmark


def register_local_benchmark(benchmark: LocalFileBenchmark, *, overwrite: bool = False) -> LocalFileBenchmark:
    """Register a benchmark read from local files under ``--data-dir`` (see ``mmpo.eval.benchmarks``)."""
    name = benchmark.name
    if benchmark.modality not in MODALITIES:
        raise ValueError(f"benchmark {name!r}: modality must be one of {MODALITIES}, got {benchmark.modality!r}")
    if name.startswith(SYNTH_PREFIX) or name.startswith(FILE_PREFIX):
        raise ValueError(f"benchmark {name!r}: names starting with {SYNTH_PREFIX!r} or {FILE_PREFIX!r} are reserved")
    if (name in BENCHMARKS or name in LOCAL_BENCHMARKS) and not overwrite:
        raise ValueError(f"benchmark {name!r} is already registered (pass overwrite=True to replace it)")
    LOCAL_BENCHMARKS[name] = benchmark
    return benchmark


def _load_plugins() -> None:
    """Import modules that register their own benchmarks; a missing module is simply absent."""
    for module_name in PLUGIN_MODULES:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Only tolerate the plugin itself (or its package) being absent, never a broken import inside it.
            if error.name is None or not module_name.startswith(error.name):
                raise


def synthetic_tasks() -> list[str]:
    """Names of the synthetic tasks (``mmpo.data.synthetic.TASKS``, registration order), including later ones."""
    from mmpo.data import synthetic

    return list(synthetic.TASKS)


def available_benchmarks() -> list[str]:
    """Every valid name: registered ones, ``synth/all``, ``synth/<task>`` and the ``file:<path>`` form."""
    _load_plugins()
    names = sorted({*BENCHMARKS, *LOCAL_BENCHMARKS})
    names += [f"{SYNTH_PREFIX}all", f"{SYNTH_PREFIX}text"] + [f"{SYNTH_PREFIX}{task}" for task in synthetic_tasks()]
    names.append(f"{FILE_PREFIX}<path>")
    return names


def describe_benchmarks() -> str:
    """What ``mmpo eval --list`` prints: every name with its modality, description and expected files."""
    _load_plugins()
    lines = []
    for name in available_benchmarks():
        if name in LOCAL_BENCHMARKS:
            local = LOCAL_BENCHMARKS[name]
            lines += [f"{name}  [{local.modality}]  {local.description}", f"    files: {local.expects()}"]
        elif name in BENCHMARKS:
            lines.append(f"{name}  [{BENCHMARKS[name].modality}]  {BENCHMARKS[name].description}".rstrip())
        else:
            lines.append(name)
    return "\n".join(lines)


def synthetic_rows(tasks: list[str], *, size: int, seed: int, split: str = "test") -> list[Row]:
    """``size`` held-out items of each task in ``tasks`` from ``split`` (``"test"``; ``"val"`` to choose settings
    without looking at the test items), deterministic by seed.

    Tasks are interleaved (item 0 of every task, then item 1, ...) so that a
    ``--limit`` keeps a mix of tasks rather than the first task only.
    """
    from mmpo.data import synthetic

    if split not in ("test", "val"):
        raise ValueError(f"synthetic split must be 'test' or 'val', got {split!r}")
    per_task = [synthetic.make_items(task, size, seed=seed, split=split) for task in tasks]
    return [items[index] for index in range(size) for items in per_task if index < len(items)]


def resolve_benchmark(
    name: str,
    *,
    synth_size: int = DEFAULT_SYNTH_SIZE,
    synth_seed: int = DEFAULT_SYNTH_SEED,
    synth_split: str = "test",
    skip_bad_rows: bool = False,
    data_dir: str | Path | None = None,
) -> Benchmark:
    """The :class:`Benchmark` for ``name``.

    Args:
        name: a registered name, ``synth/<task>``, ``synth/all`` or ``file:<path>``.
        synth_size: items per synthetic task (test split).
        synth_seed: seed of the synthetic test split.
        synth_split: which split ``synth/...`` draws from: ``"test"`` (held out) or ``"val"`` (for choosing
            settings; disjoint from train and test by content hash).
        skip_bad_rows: for ``file:`` benchmarks, skip and count malformed rows instead of failing.
        data_dir: folder holding the local-file benchmarks' files (``<data_dir>/<Benchmark>/...``), or a
            YAML file mapping benchmark names to their folders.

    Raises:
        UnknownBenchmarkError: naming ``name`` and listing the valid names.
        FileNotFoundError: for ``file:<path>`` when the path does not exist, or a local-file
            benchmark's files are missing (naming the benchmark, the path tried and the layout).
    """
    _load_plugins()
    if name in BENCHMARKS:
        return BENCHMARKS[name]
    if name in LOCAL_BENCHMARKS:
        from mmpo.eval.benchmarks.scoring import judge

        local = LOCAL_BENCHMARKS[name]
        local.check_files(data_dir)  # fails now, before any model loads
        return Benchmark(name=name, loader=functools.partial(local.load, data_dir), modality=local.modality,
                         description=local.description, judge=judge, expects=local.expects())
    if name.startswith(SYNTH_PREFIX):
        task = name[len(SYNTH_PREFIX):]
        tasks = synthetic_tasks()
        if task == "all":
            selected = tasks
        elif task == "text":  # the text-only tasks a text LM is evaluated on (docs/llm.md)
            from mmpo.data.synthetic import TEXT_TASKS

            selected = list(TEXT_TASKS)
        elif task in tasks:
            selected = [task]
        else:
            raise UnknownBenchmarkError(
                f"unknown synthetic task {task!r} in benchmark {name!r}; valid: "
                + ", ".join(f"{SYNTH_PREFIX}{t}" for t in ["all", "text", *tasks])
            )
        if synth_size < 1:
            raise ValueError(f"synth_size must be >= 1, got {synth_size}")
        if synth_split not in ("test", "val"):
            raise ValueError(f"synth_split must be 'test' or 'val', got {synth_split!r}")
        return Benchmark(
            name=name,
            loader=lambda: synthetic_rows(selected, size=synth_size, seed=synth_seed, split=synth_split),
            modality="vlm",
            description=f"synthetic {synth_split} split, {synth_size} items per task, seed {synth_seed}",
        )
    if name.startswith(FILE_PREFIX):
        path = Path(name[len(FILE_PREFIX):]).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"benchmark {name!r}: no such file or directory: {path}")

        def load_file_rows() -> list[Row]:
            from mmpo.data.loaders import load_rows

            rows, _stats = load_rows(str(path), skip_bad_rows=skip_bad_rows)
            if not rows:
                raise ValueError(f"benchmark {name!r}: {path} holds no usable rows")
            return list(rows)

        return Benchmark(name=name, loader=load_file_rows, modality="vlm", description=f"local file {path}")
    raise UnknownBenchmarkError(f"unknown benchmark {name!r}; valid: {', '.join(available_benchmarks())}")


def load_benchmark_rows(benchmark: Benchmark, *, limit: int | None = None) -> list[Row]:
    """Call the benchmark's loader and keep the first ``limit`` rows (all when ``None``)."""
    rows = list(benchmark.loader())
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"benchmark {benchmark.name!r} loaded no rows")
    return rows
