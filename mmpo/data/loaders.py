"""Load Rows from local files: HF ``datasets`` saved to disk, parquet, arrow, jsonl/json.

Schemas (``schema="auto"`` detects them from the column names):
- ``row``: mmpo's own Row fields (as written by ``save_rows_jsonl``).
- ``geometry3k``: any question/answer table (Geometry3K, ViRL39K, R1-VL-10K, MathVista, ...):
  a prompt column (``prompt_key``, default the first of ``DEFAULT_PROMPT_KEYS`` present),
  an answer column (``answer_key``, default ``answer``; a ``\\boxed{}`` answer is unwrapped),
  optional images (``image_key``), options (``choices_key``, see ``mmpo.data.choices``),
  ``solution`` / ``steps``, ``key_steps`` (R1-VL-10K layout: ``{"Steps": [group, ...]}``,
  a group being a string or a list of equivalent strings), ``expert_trace``,
  ``id`` / ``qid`` / ``pid``, ``difficulty``, ``needs_image``.

Images may be PIL images (HF ``Image`` feature), ``{"bytes": ..., "path": ...}`` dicts,
raw bytes, or file paths relative to ``image_root`` (default: the data file's folder); a
row holds one image, a list of them, or none. ``<image>`` placeholders are removed from
the problem text (the processor adds its own).

``open_rows`` decodes no image while loading: it returns a ``LazyImageRows`` whose rows
decode their images when read (per batch, in the DataLoader). ``load_rows`` returns a
plain list with every image decoded (small eval sets).

A bad row (missing or corrupt image, empty answer, missing prompt) raises
``BadRowError`` naming its index and id, or with ``skip_bad_rows=True`` is skipped
and counted in the returned stats.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from mmpo.data.choices import gold_letter, parse_choices, prompt_with_choices
from mmpo.data.format_prompt import apply_format_prompt, check_format_prompt
from mmpo.data.images import as_image_list, check_image_refs, open_image
from mmpo.data.lazy_rows import HFImageColumn, LazyImageRows
from mmpo.data.schema import BadRowError, Row, describe_row, validate_row
from mmpo.data.solution import render_solution

logger = logging.getLogger(__name__)

SCHEMAS: tuple[str, ...] = ("auto", "row", "geometry3k")

#: default prompt columns, first present wins: MathVista's ``query`` holds the question with its
#: instruction and options, so it goes before the bare ``question``
DEFAULT_PROMPT_KEYS = ("query", "problem", "question", "prompt")
#: MathVista's ``decoded_image`` is the embedded image; its ``image`` is a relative path
DEFAULT_IMAGE_KEYS = ("images", "decoded_image", "image", "image_path", "image_paths", "img")
DEFAULT_CHOICES_KEYS = ("choices", "options")
_ID_COLUMNS = ("id", "qid", "uid", "pid")
_STEPS_COLUMNS = ("steps", "solution", "rationale", "cot")
_EXPERT_COLUMNS = ("expert_trace", "expert", "trace")
_PLACEHOLDER_RE = re.compile(r"<image>|<\|image_pad\|>|<\|vision_start\|>|<\|vision_end\|>")


@dataclass(frozen=True)
class ColumnKeys:
    """Which columns hold what (EasyR1's ``prompt_key`` / ``answer_key`` / ``image_key``).

    None means "the first default column present" (``DEFAULT_*_KEYS``); a name given here
    must be present in every row. ``system_prompt`` becomes the rows' system turn;
    ``format_prompt`` (an EasyR1 jinja template, file or text, using ``{{ content }}``) wraps
    each prompt, after its options.
    """

    prompt_key: str | None = None
    answer_key: str | None = None
    image_key: str | None = None
    choices_key: str | None = None
    system_prompt: str | None = None
    format_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.format_prompt is not None:
            check_format_prompt(self.format_prompt)  # a bad template fails at config time, not mid-run


def _first_key(record: dict[str, Any], names: Iterable[str]) -> str | None:
    for name in names:
        if name in record and record[name] is not None:
            return name
    return None


def _columns_note(columns: Iterable[str]) -> str:
    return f"the dataset has columns {sorted(columns)}"


def _prompt_key(record: dict[str, Any], key: str | None, ref: str, columns: Iterable[str]) -> str:
    """The column holding the prompt (non-empty), or a BadRowError naming row, key and columns."""
    if key is not None:
        if key not in record:
            raise BadRowError(f"{ref}: no column {key!r} (prompt_key); {_columns_note(columns)}")
        if record[key] is None or not str(record[key]).strip():
            raise BadRowError(f"{ref}: missing problem: column {key!r} (prompt_key) is empty")
        return key
    found = _first_key(record, DEFAULT_PROMPT_KEYS)
    if found is not None and (record[found] is None or not str(record[found]).strip()):
        raise BadRowError(f"{ref}: empty prompt: column {found!r} (the prompt read; prompt_key) is empty")
    if found is None:
        raise BadRowError(
            f"{ref}: missing problem (looked for {list(DEFAULT_PROMPT_KEYS)}; set prompt_key to name the column); "
            f"{_columns_note(columns)}"
        )
    return found


def _unwrap_boxed(answer: str) -> str:
    from mmpo.rewards.answers import last_boxed  # local import: rewards imports data

    boxed = last_boxed(answer)
    return boxed.strip() if boxed is not None else answer.strip()


def _key_step_groups(value: Any, ref: str) -> list[list[str]]:
    """Normalise key steps: R1-VL-10K's ``{"Steps": [...]}``, a list, or a JSON string of either."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRowError(f"{ref}: key_steps is not valid JSON ({exc})") from exc
    if isinstance(value, dict):
        value = value.get("Steps", value.get("steps", []))
    if not isinstance(value, list):
        raise BadRowError(f"{ref}: key_steps must be a list of groups, got {type(value).__name__}")
    groups: list[list[str]] = []
    for group in value:
        alternatives = [group] if isinstance(group, str) else list(group or [])
        alternatives = [str(a).strip() for a in alternatives if str(a).strip()]
        if alternatives:
            groups.append(alternatives)
    return groups


def _steps_from(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(s).strip() for s in value if str(s).strip()]
    text = str(value).strip()
    # A free-text solution: one step per non-empty line.
    return [line.strip() for line in text.splitlines() if line.strip()]


def _detect_schema(columns: Iterable[str], keys: ColumnKeys = ColumnKeys()) -> str:
    cols = set(columns)
    if {"problem", "answer", "steps", "key_steps", "needs_image"} <= cols and keys.prompt_key is None:
        return "row"
    if keys.prompt_key is not None:
        if keys.prompt_key not in cols:
            raise ValueError(f"no column {keys.prompt_key!r} (prompt_key); {_columns_note(cols)}")
    elif _first_key(dict.fromkeys(cols, 1), DEFAULT_PROMPT_KEYS) is None:
        raise ValueError(f"cannot detect the schema: expected a prompt column (one of {DEFAULT_PROMPT_KEYS}, "
                         f"or set prompt_key); {_columns_note(cols)}")
    if keys.answer_key is not None and keys.answer_key not in cols:
        raise ValueError(f"no column {keys.answer_key!r} (answer_key); {_columns_note(cols)}")
    if keys.answer_key is None and "answer" not in cols:
        raise ValueError(f"cannot detect the schema: no answer column 'answer' (set answer_key); "
                         f"{_columns_note(cols)}")
    return "geometry3k"


def _choices(record: dict[str, Any], keys: ColumnKeys, ref: str, columns: Iterable[str]) -> list[str]:
    if keys.choices_key is not None:
        if keys.choices_key not in record:
            raise BadRowError(f"{ref}: no column {keys.choices_key!r} (choices_key); {_columns_note(columns)}")
        value = record[keys.choices_key]
    else:
        found = _first_key(record, DEFAULT_CHOICES_KEYS)
        value = record[found] if found else None
    if isinstance(value, str) and value.strip().startswith("[") and "'" in value:
        try:  # MMMU stores options as a Python list literal
            value = list(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            pass
    return parse_choices(value, ref)


def row_fields(record: dict[str, Any], index: int, *, source: str, keys: ColumnKeys = ColumnKeys(),
               columns: Iterable[str] | None = None,
               image_count: int | None = None) -> tuple[dict[str, Any], list[Any]]:
    """One raw record -> (its Row fields except ``images``, its raw image values); no image is decoded.

    ``image_count`` given: the record holds no image column (an HF table's images are read only
    when a row is); the raw image values returned are then empty. Raises ``BadRowError`` naming
    the row, the missing key and the dataset's columns.
    """
    columns = list(record) if columns is None else list(columns)
    id_key = _first_key(record, _ID_COLUMNS)
    row_id = str(record[id_key]) if id_key else f"{source}-{index}"
    ref = describe_row(index, row_id)
    problem_key = _prompt_key(record, keys.prompt_key, ref, columns)
    problem = _PLACEHOLDER_RE.sub("", str(record[problem_key])).strip()
    if not problem:
        raise BadRowError(f"{ref}: empty prompt: column {problem_key!r} (prompt_key) holds only image placeholders")
    answer_key = keys.answer_key or "answer"
    if answer_key not in record:
        raise BadRowError(f"{ref}: no column {answer_key!r} (answer_key); {_columns_note(columns)}")
    raw_answer = record[answer_key]
    answer = _unwrap_boxed(str(raw_answer)) if raw_answer is not None else ""  # keep a numeric 0
    if not answer:
        raise BadRowError(f"{ref}: empty answer (column {answer_key!r})")
    options = _choices(record, keys, ref, columns)
    if options:
        problem = prompt_with_choices(problem, options)
    if keys.format_prompt is not None:
        problem = apply_format_prompt(keys.format_prompt, problem)
    if image_count is not None:
        raw_images = []
    elif keys.image_key is not None:
        # a json record without the key is text-only (open_rows refuses a file where no row has it)
        raw_images = as_image_list(record.get(keys.image_key))
    else:
        image_key = _first_key(record, DEFAULT_IMAGE_KEYS)
        raw_images = as_image_list(record[image_key]) if image_key else []
    n_images = len(raw_images) if image_count is None else image_count
    steps_key = _first_key(record, _STEPS_COLUMNS)
    expert_key = _first_key(record, _EXPERT_COLUMNS)
    difficulty = record.get("difficulty")
    try:
        difficulty = min(3, max(1, int(difficulty))) if difficulty is not None else 2
    except (TypeError, ValueError) as exc:
        raise BadRowError(f"{ref}: difficulty {difficulty!r} is not an integer") from exc
    needs_image = record.get("needs_image")
    fields: dict[str, Any] = {
        "id": row_id,
        "task": str(record.get("task") or source),
        "problem": problem,
        "answer": answer,
        "steps": _steps_from(record[steps_key]) if steps_key else [],
        "key_steps": _key_step_groups(record.get("key_steps"), ref),
        "expert_trace": str(record[expert_key]) if expert_key else None,
        "difficulty": difficulty,
        "needs_image": bool(n_images) if needs_image is None else bool(needs_image),
    }
    if options:
        fields["answer"], fields["answer_text"] = gold_letter(answer, options, ref)
        fields["choices"] = options
    if keys.system_prompt is not None:
        fields["system_prompt"] = keys.system_prompt
    for extra in ("image_description", "rationale"):
        if isinstance(record.get(extra), str):
            fields[extra] = record[extra]
    if fields["expert_trace"] is None and fields["steps"]:
        fields["expert_trace"] = render_solution(fields)  # AHPO default: the rendered reference solution
    validate_row({**fields, "images": []}, index, image_count=n_images)
    return fields, raw_images


def record_to_row(record: dict[str, Any], index: int, *, image_root: Path, source: str,
                  keys: ColumnKeys = ColumnKeys()) -> Row:
    """Convert one raw record (any supported schema) into a validated Row, images decoded."""
    fields, raw_images = row_fields(record, index, source=source, keys=keys)
    ref = describe_row(index, fields["id"])
    images = [open_image(v, image_root, ref) for v in raw_images]
    row: Row = {**fields, "images": images}  # type: ignore[typeddict-item]
    validate_row(row, index)
    return row


def _iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json file must hold a list of records")
        yield from data
        return
    with path.open() as handle:
        for line_no, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                # An unparsable line has no id; name its line number.
                yield {"__bad_json__": f"line {line_no + 1}: {exc}"}


#: split names of the HF hub's parquet layout (``data/<split>-00000-of-00001.parquet``)
KNOWN_SPLITS = ("train", "test", "validation", "val", "valid", "dev", "testmini")


def _split_files(files: list[Path], folder: Path, split: str | None) -> list[Path]:
    """The parquet files of one split when a folder holds several (the hub's layout names each
    file ``<split>-...`` or puts it in a ``<split>/`` folder); all files otherwise. Reading every
    split as one would mix a test set into training."""
    def split_of(file: Path) -> str | None:
        for name in (file.stem.split("-")[0], file.parent.name):
            if name in KNOWN_SPLITS:
                return name
        return None

    splits = {file: split_of(file) for file in files}
    names = sorted({name for name in splits.values() if name is not None})
    if None in splits.values() or (len(names) < 2 and split is None):
        return files
    chosen = split or "train"
    if chosen not in names:
        raise ValueError(f"{folder}: parquet files of the splits {names}; pass split=<one of them>")
    return [file for file, name in splits.items() if name == chosen]


def _open_hf(path: Path, split: str | None) -> Any:
    """A memory-mapped HF ``Dataset`` (image decoding off) from a save_to_disk folder, parquet or arrow."""
    import datasets  # heavy; only needed for these formats

    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            chosen = split or ("train" if "train" in data else None)
            if chosen not in data:
                raise ValueError(f"{path}: a DatasetDict with splits {list(data)}; pass split=<one of them>")
            data = data[chosen]
    elif path.suffix == ".arrow" or (path.is_dir() and not any(path.rglob("*.parquet"))):
        files = sorted(path.rglob("*.arrow")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no parquet or arrow files found")
        data = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
    else:
        files = _split_files(sorted(path.rglob("*.parquet")), path, split) if path.is_dir() else [path]
        data = datasets.Dataset.from_parquet([str(f) for f in files])
    if data._indices is not None:  # positions below index the table directly
        data = data.flatten_indices()
    return _without_image_decoding(data)


def _without_image_decoding(data: Any) -> Any:
    """Turn off ``datasets``' image decoding: images stay encoded bytes until a row is read, and a
    corrupt image fails in the loader (which names the row) instead of inside the dataset iterator."""
    import datasets

    for name, feature in data.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            data = data.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(
            getattr(feature, "feature", None), datasets.Image
        ):
            data = data.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return data


def _is_json(path: Path) -> bool:
    return path.is_file() and path.suffix in (".jsonl", ".json")


def _check_data_path(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if not (_is_json(path) or path.is_dir() or path.suffix in (".parquet", ".arrow")):
        raise ValueError(
            f"{path}: unsupported data file; use .jsonl, .json, .parquet, .arrow or a save_to_disk folder"
        )


def iter_records(path: str | Path, *, split: str | None = None) -> Iterator[dict[str, Any]]:
    """Raw records from a local file or folder (format from the suffix / folder contents)."""
    path = Path(path)
    _check_data_path(path)
    yield from _iter_jsonl(path) if _is_json(path) else _open_hf(path, split)


def _image_column(columns: Sequence[str], keys: ColumnKeys) -> str | None:
    if keys.image_key is not None:
        return keys.image_key if keys.image_key in columns else None
    return next((name for name in DEFAULT_IMAGE_KEYS if name in columns), None)


class _Records:
    """A dataset's records for the loading pass, with image columns kept out of an HF table
    (their bytes are read only when a row's images are decoded)."""

    def __init__(self, path: Path, split: str | None, keys: ColumnKeys) -> None:
        _check_data_path(path)
        self.table: Any = None
        self.image_column: str | None = None
        if _is_json(path):
            self.columns: list[str] | None = None
            self.text: Iterable[dict[str, Any]] = _iter_jsonl(path)
            return
        self.table = _open_hf(path, split)
        self.columns = list(self.table.column_names)
        self.image_column = _image_column(self.columns, keys)
        hidden = [c for c in self.columns if c in DEFAULT_IMAGE_KEYS or c == keys.image_key]
        self.text = self.table.remove_columns(hidden) if hidden else self.table
        # the row's image count (for needs_image and the checks) without reading the bytes
        self._counts = _image_counts(self.table, self.image_column) if self.image_column else None

    def check_images(self, position: int, images: list[Any], root: Path, ref: str, *, decode: bool) -> None:
        """Raise ``BadRowError`` for a row's unusable images: json rows' files must exist; with
        ``decode`` every image is decoded once and dropped (so bad rows can be skipped now)."""
        if self.table is None:
            check_image_refs(images, root, ref)
        elif decode and self.image_column is not None:
            images = as_image_list(self.table[position][self.image_column])
        if decode:
            for value in images:
                open_image(value, root, ref)

    def image_count(self, position: int) -> int | None:
        """Images of an HF table's row (None for json records, whose images are in the record)."""
        if self.table is None:
            return None
        return self._counts[position] if self._counts is not None else 0


def _image_counts(table: Any, column: str) -> list[int]:
    """Images per row of an arrow column (a list of images, or one image / path) from its
    offsets and validity bitmaps, so no image bytes are read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = table.data.column(column)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return [n or 0 for n in pc.list_value_length(array).to_pylist()]
    return [int(v) for v in pc.is_valid(array).to_pylist()]


def split_path_spec(path: str | Path, split: str | None = None) -> tuple[Path, str | None]:
    """EasyR1's ``folder@split`` (``data/geometry3k@test``): the folder and the split. A path that
    exists as written is taken as is; an explicit ``split`` argument wins over the suffix."""
    text = str(path)
    if Path(text).exists() or "@" not in text:
        return Path(text), split
    folder, _, suffix = text.rpartition("@")
    if not suffix or "/" in suffix:
        return Path(text), split
    return Path(folder), split or suffix


def open_rows(
    path: str | Path,
    *,
    schema: str = "auto",
    skip_bad_rows: bool = False,
    image_root: str | Path | None = None,
    split: str | None = None,
    keys: ColumnKeys = ColumnKeys(),
) -> tuple[LazyImageRows, dict[str, Any]]:
    """Load a local dataset's rows without decoding their images (they decode when a row is read).

    Args: as ``load_rows``.

    Every row's text fields are read and validated here; image files are checked to exist. With
    ``skip_bad_rows=True`` every image is also decoded once (and dropped) so that corrupt ones
    are skipped now rather than stopping training later; with the default ``False`` a corrupt
    image raises ``BadRowError`` naming the row when its batch is built.
    """
    if schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}; valid: {SCHEMAS}")
    path, split = split_path_spec(path, split)
    root = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    source = path.stem or "data"
    records = _Records(path, split, keys)
    fields_list: list[dict[str, Any]] = []
    raw_images: list[Any] = []
    positions: list[int] = []
    errors: list[str] = []
    seen_ids: set[str] = set()
    image_key_seen = False
    first_columns: list[str] = []
    total = 0
    detected: str | None = None if schema == "auto" else schema
    for index, record in enumerate(records.text):
        total += 1
        try:
            if "__bad_json__" in record:
                raise BadRowError(f"{describe_row(index, None)}: invalid JSON at {record['__bad_json__']}")
            id_key = _first_key(record, _ID_COLUMNS)
            ref = describe_row(index, record[id_key] if id_key else None)
            columns = records.columns if records.columns is not None else list(record)
            if detected is None:
                try:
                    detected = _detect_schema(columns, keys)
                except ValueError as exc:  # a malformed first row: name it, and try the next one
                    raise BadRowError(f"{ref}: {exc}") from exc
            missing = [f for f in ("problem", "answer", "steps", "key_steps") if f not in record]
            if detected == "row" and missing:
                raise BadRowError(f"{ref}: schema 'row' but missing {missing}")
            if records.table is not None and keys.image_key is not None and records.image_column is None:
                raise BadRowError(f"{ref}: no column {keys.image_key!r} (image_key); {_columns_note(columns)}")
            fields, images = row_fields(record, index, source=source, keys=keys, columns=columns,
                                        image_count=records.image_count(index))
            ref = describe_row(index, fields["id"])
            if fields["id"] in seen_ids:
                raise BadRowError(f"{ref}: duplicate id")
            records.check_images(index, images, root, ref, decode=skip_bad_rows)
            seen_ids.add(fields["id"])
        except BadRowError as exc:
            if not skip_bad_rows:
                raise BadRowError(f"{path}: {exc}") from exc
            errors.append(str(exc))
            continue
        if not fields_list:
            first_columns = list(record)
        fields_list.append(fields)
        positions.append(index)
        image_key_seen = image_key_seen or (keys.image_key is not None and keys.image_key in record)
        if records.table is None:
            raw_images.append(images)
    if keys.image_key is not None and records.table is None and fields_list and not image_key_seen:
        raise BadRowError(f"{path}: no row has the column {keys.image_key!r} (image_key); row "
                          f"{positions[0]} has columns {sorted(first_columns)}")
    if errors:
        logger.warning("%s: skipped %d of %d rows; first: %s", path, len(errors), total, errors[0])
    if records.table is None:
        images_by_row: Sequence[Any] = raw_images
    elif records.image_column is not None:
        images_by_row = HFImageColumn(records.table, records.image_column, positions)
    else:
        images_by_row = [[] for _ in positions]
    rows = LazyImageRows(fields_list, images_by_row, image_root=root, source=str(path), row_numbers=positions)
    stats = {"total": total, "loaded": len(rows), "skipped": len(errors), "errors": errors, "schema": detected}
    return rows, stats


def load_rows(
    path: str | Path,
    *,
    schema: str = "auto",
    skip_bad_rows: bool = False,
    image_root: str | Path | None = None,
    split: str | None = None,
    keys: ColumnKeys = ColumnKeys(),
) -> tuple[list[Row], dict[str, Any]]:
    """Load Rows from a local dataset, every image decoded (``open_rows`` decodes on access).

    Args:
        path: a ``.jsonl`` / ``.json`` file, a ``.parquet`` / ``.arrow`` file or a folder of them, or
            a ``save_to_disk`` folder (Dataset or DatasetDict); ``folder@split`` names a split.
        schema: "auto", "row" or "geometry3k" (any question/answer table).
        skip_bad_rows: skip and count bad rows instead of raising ``BadRowError``.
        image_root: folder that relative image paths are resolved against (default: the
            data file's folder, or the folder itself).
        split: which split of a saved DatasetDict (default "train").
        keys: column overrides (``prompt_key``, ``answer_key``, ``image_key``, ``choices_key``)
            and a ``system_prompt`` for the rows.

    Returns:
        rows: list of validated Rows.
        stats: ``{"total", "loaded", "skipped", "errors": [messages of skipped rows], "schema"}``.
    """
    rows, stats = open_rows(path, schema=schema, skip_bad_rows=skip_bad_rows, image_root=image_root, split=split,
                            keys=keys)
    return list(rows), stats


def _image_to_file(image: Image.Image, folder: Path, name: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    image.save(folder / name)
    return f"{folder.name}/{name}"


def save_rows_jsonl(rows: list[Row], path: str | Path) -> Path:
    """Write Rows as jsonl with images saved as PNG files in ``<stem>_images/`` beside it.

    ``load_rows`` reads the file back into equal Rows (image pixels included).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_dir = path.parent / f"{path.stem}_images"
    with path.open("w") as handle:
        for k, row in enumerate(rows):
            record = {key: value for key, value in row.items() if key != "images"}
            record["images"] = [
                _image_to_file(im, image_dir, f"{k:06d}_{j}.png") for j, im in enumerate(row["images"])
            ]
            handle.write(json.dumps(record) + "\n")
    return path
