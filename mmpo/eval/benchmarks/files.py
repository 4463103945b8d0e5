"""Find and read a benchmark's local files in the layout its publisher ships.

A benchmark named ``B`` with folder ``D`` and split ``S`` reads ``DATA_DIR/D`` holding any of:

* a ``datasets`` ``save_to_disk`` folder: ``DATA_DIR/D`` itself (a ``DatasetDict`` with split
  ``S``, or a single ``Dataset``) or ``DATA_DIR/D/S``;
* parquet files as the Hub ships them: ``DATA_DIR/D/**/S-*.parquet`` or ``**/S.parquet``
  (e.g. ``data/testmini-00000-of-00001.parquet``; MMMU's ``<Subject>/validation-0000...parquet``);
* arrow files as ``load_dataset`` caches them: ``**/*-S.arrow`` or ``**/*-S-*.arrow``;
* a jsonl file: ``**/S.jsonl`` (MATH-500 ships ``test.jsonl``).

``DATA_DIR`` may instead be a YAML file naming each benchmark's folder (:func:`benchmark_root`).

Images stay undecoded here (``{"bytes", "path"}`` dicts or path strings) and are decoded per
batch by :func:`decode_image`, so a 4,000-item benchmark does not sit in RAM as bitmaps.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from PIL import Image


class BenchmarkFilesError(FileNotFoundError):
    """A benchmark's local files are missing or lack columns; names the benchmark, the path and the layout."""


@dataclass(frozen=True)
class Layout:
    """Where a benchmark's files live under ``--data-dir`` and what they hold.

    Attributes:
        dir_name: folder under the data dir (e.g. ``MathVista``).
        split: split name in the file names (``testmini``, ``test``, ``validation``).
        columns: columns every row must have (publisher's names).
        source: the publisher's dataset (e.g. ``AI4Math/MathVista``), for messages and ``--list``.
    """

    dir_name: str
    split: str
    columns: tuple[str, ...]
    source: str

    def expects(self) -> str:
        """One line describing the expected files, used by ``--list`` and error messages."""
        split = self.split
        return (f"<data-dir>/{self.dir_name}/ holding {self.source} split '{split}': **/{split}-*.parquet "
                f"(or {split}.parquet), **/*-{split}.arrow, **/{split}.jsonl or a save_to_disk folder; "
                f"columns {', '.join(self.columns)}")


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def _glob(root: Path, patterns: Iterable[str]) -> list[Path]:
    found: set[Path] = set()
    for pattern in patterns:
        found.update(path for path in root.glob(pattern) if path.is_file())
    return sorted(found)


def find_files(root: Path, split: str) -> tuple[str, list[Path]]:
    """The format (``disk``, ``parquet``, ``arrow``, ``jsonl``) and files of ``split`` under ``root``.

    Returns ``("", [])`` when nothing matches.
    """
    if root.is_dir() and _is_saved_dataset(root):
        return "disk", [root]
    if (root / split).is_dir() and _is_saved_dataset(root / split):
        return "disk", [root / split]
    if not root.is_dir():
        return "", []
    candidates = {
        "parquet": (f"**/{split}-*.parquet", f"**/{split}.parquet", f"**/{split}/*.parquet"),
        "arrow": (f"**/*-{split}.arrow", f"**/*-{split}-*.arrow"),
        "jsonl": (f"**/{split}.jsonl",),
    }
    for kind, patterns in candidates.items():
        files = _glob(root, patterns)
        if files:
            return kind, files
    return "", []


def _open_dataset(benchmark: str, kind: str, files: list[Path], layout: Layout) -> Any:
    import datasets  # heavy; only needed here

    split = layout.split
    if kind == "disk":
        data = datasets.load_from_disk(str(files[0]))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise BenchmarkFilesError(f"benchmark {benchmark!r}: {files[0]} is a DatasetDict with splits "
                                          f"{list(data)}, no '{split}'; expected {layout.expects()}")
            data = data[split]
        return data
    if kind == "parquet":
        return datasets.Dataset.from_parquet([str(path) for path in files])
    if kind == "arrow":
        return datasets.concatenate_datasets([datasets.Dataset.from_file(str(path)) for path in files])
    return datasets.Dataset.from_json([str(path) for path in files])


def _undecoded(data: Any) -> Any:
    """Image columns as raw ``{"bytes", "path"}`` dicts: decoded per batch, and a corrupt image names its row."""
    import datasets

    for name, feature in data.features.items():
        if isinstance(feature, datasets.Image):
            data = data.cast_column(name, datasets.Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), datasets.Image):
            data = data.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return data


def benchmark_root(benchmark: str, data_dir: str | Path | None, layout: Layout) -> Path:
    """The folder holding ``benchmark``'s files.

    ``data_dir`` is either a folder (the benchmark's files are under ``data_dir/<layout.dir_name>``) or a
    YAML file mapping benchmark names (or folder names) to their folders, relative paths being read from
    the YAML file's folder: ``{mathvista_testmini: /data/MathVista, ChartQA: chartqa_copy}``.
    """
    if data_dir is None:
        raise BenchmarkFilesError(f"benchmark {benchmark!r} reads local files: pass --data-dir DIR; "
                                  f"expected {layout.expects()}")
    path = Path(data_dir).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        return path / layout.dir_name
    import yaml

    if not path.is_file():
        raise BenchmarkFilesError(f"benchmark {benchmark!r}: data-dir YAML {path} does not exist")
    mapping = yaml.safe_load(path.read_text()) or {}
    if not isinstance(mapping, dict):
        raise BenchmarkFilesError(f"{path}: expected a mapping of benchmark name -> folder, got "
                                  f"{type(mapping).__name__}")
    folder = mapping.get(benchmark, mapping.get(layout.dir_name))
    if folder is None:
        raise BenchmarkFilesError(f"benchmark {benchmark!r}: {path} has no entry {benchmark!r} (or "
                                  f"{layout.dir_name!r}); expected its folder holding {layout.expects()}")
    folder = Path(str(folder)).expanduser()
    return folder if folder.is_absolute() else path.parent / folder


def locate_files(benchmark: str, data_dir: str | Path | None, layout: Layout) -> tuple[Path, str, list[Path]]:
    """``(root, format, files)`` of ``benchmark``; raises :class:`BenchmarkFilesError` naming the
    benchmark, the path tried and the expected layout when there are none."""
    root = benchmark_root(benchmark, data_dir, layout)
    kind, files = find_files(root, layout.split)
    if not files:
        raise BenchmarkFilesError(f"benchmark {benchmark!r}: no '{layout.split}' files found under {root}; "
                                  f"expected {layout.expects()}")
    return root, kind, files


def read_records(benchmark: str, data_dir: str | Path, layout: Layout) -> tuple[Path, Iterator[dict[str, Any]]]:
    """``(benchmark root folder, records)`` of ``layout`` for ``data_dir`` (see :func:`benchmark_root`).

    Raises:
        BenchmarkFilesError: no file of the split there, or a required column missing; the message
            names the benchmark, the path tried and the expected layout.
    """
    root, kind, files = locate_files(benchmark, data_dir, layout)
    data = _undecoded(_open_dataset(benchmark, kind, files, layout))
    missing = [column for column in layout.columns if column not in data.column_names]
    if missing:
        raise BenchmarkFilesError(f"benchmark {benchmark!r}: {files[0]} lacks column(s) {missing} "
                                  f"(has {data.column_names}); expected {layout.expects()}")
    return root, iter(data)


def image_source(value: Any, index: int) -> str:
    """A short, JSON-safe description of an undecoded image for the per-item report."""
    if isinstance(value, dict):
        return value.get("path") or f"<embedded image {index}>"
    if isinstance(value, (str, Path)):
        return str(value)
    return f"<embedded image {index}>"


def decode_image(value: Any, root: Path) -> Image.Image:
    """An RGB image from a PIL image, an HF ``{"bytes", "path"}`` dict, raw bytes or a path under ``root``."""
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict) and value.get("bytes"):
        image = Image.open(io.BytesIO(value["bytes"]))
    elif isinstance(value, dict) and value.get("path"):
        return decode_image(value["path"], root)
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, (str, Path)) and str(value):
        path = Path(value) if Path(value).is_absolute() else root / value
        if not path.is_file():
            raise FileNotFoundError(f"image file not found: {path}")
        image = Image.open(path)
    else:
        raise ValueError(f"unsupported image value of type {type(value).__name__}")
    image.load()
    return image.convert("RGB")
