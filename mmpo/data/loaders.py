"""Load Rows from local files: HF ``datasets`` saved to disk, parquet, jsonl/json.

Schemas (``schema="auto"`` detects them from the column names):
- ``row``: mmpo's own Row fields (as written by ``save_rows_jsonl``).
- ``geometry3k``: Geometry3K / ViRL39K style: ``images`` (or ``image``), ``problem``
  (or ``question``), ``answer`` (a ``\\boxed{}`` answer is unwrapped); optional
  ``solution`` / ``steps``, ``key_steps`` (R1-VL-10K layout: ``{"Steps": [group, ...]}``,
  a group being a string or a list of equivalent strings), ``expert_trace``,
  ``id`` / ``qid``, ``difficulty``, ``needs_image``.

Images may be PIL images (HF ``Image`` feature), ``{"bytes": ..., "path": ...}`` dicts,
raw bytes, or file paths relative to ``image_root`` (default: the data file's folder).
``<image>`` placeholders are removed from the problem text (the processor adds its own).

A bad row (missing or corrupt image, empty answer, missing problem) raises
``BadRowError`` naming its index and id, or with ``skip_bad_rows=True`` is skipped
and counted in the returned stats.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from mmpo.data.schema import BadRowError, Row, describe_row, validate_row
from mmpo.data.solution import render_solution

logger = logging.getLogger(__name__)

SCHEMAS: tuple[str, ...] = ("auto", "row", "geometry3k")

_IMAGE_COLUMNS = ("images", "image", "image_path", "image_paths", "img")
_PROBLEM_COLUMNS = ("problem", "question", "query", "prompt")
_ID_COLUMNS = ("id", "qid", "uid", "pid")
_STEPS_COLUMNS = ("steps", "solution", "rationale", "cot")
_EXPERT_COLUMNS = ("expert_trace", "expert", "trace")
_PLACEHOLDER_RE = re.compile(r"<image>|<\|image_pad\|>|<\|vision_start\|>|<\|vision_end\|>")


def _first_key(record: dict[str, Any], names: Iterable[str]) -> str | None:
    for name in names:
        if name in record and record[name] is not None:
            return name
    return None


def _open_image(value: Any, root: Path, ref: str) -> Image.Image:
    """One image from a PIL image, an HF Image dict, bytes, or a path (relative to root)."""
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict):
            if value.get("bytes"):
                image = Image.open(io.BytesIO(value["bytes"]))
            elif value.get("path"):
                return _open_image(value["path"], root, ref)
            else:
                raise BadRowError(f"{ref}: image dict has neither 'bytes' nor 'path'")
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            path = Path(value)
            path = path if path.is_absolute() else root / path
            if not path.is_file():
                raise BadRowError(f"{ref}: image file not found: {path}")
            image = Image.open(path)
        else:
            raise BadRowError(f"{ref}: unsupported image value of type {type(value).__name__}")
        image.load()  # decode now so a corrupt file fails here, naming the row
        return image.convert("RGB")
    except BadRowError:
        raise
    except Exception as exc:  # PIL raises several types for corrupt data
        raise BadRowError(f"{ref}: cannot read image ({type(exc).__name__}: {exc})") from exc


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


def _detect_schema(columns: Iterable[str]) -> str:
    cols = set(columns)
    if {"problem", "answer", "steps", "key_steps", "needs_image"} <= cols:
        return "row"
    if _first_key(dict.fromkeys(cols, 1), _PROBLEM_COLUMNS) and "answer" in cols:
        return "geometry3k"
    raise ValueError(
        f"cannot detect the schema from columns {sorted(cols)}; expected a problem column "
        f"(one of {_PROBLEM_COLUMNS}) and 'answer'"
    )


def record_to_row(record: dict[str, Any], index: int, *, image_root: Path, source: str) -> Row:
    """Convert one raw record (any supported schema) into a validated Row; raises BadRowError."""
    id_key = _first_key(record, _ID_COLUMNS)
    row_id = str(record[id_key]) if id_key else f"{source}-{index}"
    ref = describe_row(index, row_id)
    problem_key = _first_key(record, _PROBLEM_COLUMNS)
    if problem_key is None or not str(record[problem_key]).strip():
        raise BadRowError(f"{ref}: missing problem (looked for {_PROBLEM_COLUMNS})")
    problem = _PLACEHOLDER_RE.sub("", str(record[problem_key])).strip()
    if not problem:
        raise BadRowError(f"{ref}: problem is empty after removing image placeholders")
    raw_answer = record.get("answer")
    answer = _unwrap_boxed(str(raw_answer)) if raw_answer is not None else ""  # keep a numeric 0
    if not answer:
        raise BadRowError(f"{ref}: empty answer")
    image_key = _first_key(record, _IMAGE_COLUMNS)
    raw_images = record[image_key] if image_key else []
    if raw_images is None:
        raw_images = []
    if not isinstance(raw_images, (list, tuple)):
        raw_images = [raw_images]
    images = [_open_image(v, image_root, ref) for v in raw_images]
    steps_key = _first_key(record, _STEPS_COLUMNS)
    expert_key = _first_key(record, _EXPERT_COLUMNS)
    difficulty = record.get("difficulty")
    try:
        difficulty = min(3, max(1, int(difficulty))) if difficulty is not None else 2
    except (TypeError, ValueError) as exc:
        raise BadRowError(f"{ref}: difficulty {difficulty!r} is not an integer") from exc
    needs_image = record.get("needs_image")
    row: Row = {
        "id": row_id,
        "task": str(record.get("task") or source),
        "images": images,
        "problem": problem,
        "answer": answer,
        "steps": _steps_from(record[steps_key]) if steps_key else [],
        "key_steps": _key_step_groups(record.get("key_steps"), ref),
        "expert_trace": str(record[expert_key]) if expert_key else None,
        "difficulty": difficulty,
        "needs_image": bool(images) if needs_image is None else bool(needs_image),
    }
    for extra in ("image_description", "rationale"):
        if isinstance(record.get(extra), str):
            row[extra] = record[extra]
    if row["expert_trace"] is None and row["steps"]:
        row["expert_trace"] = render_solution(row)  # AHPO default: the rendered reference solution
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


def _iter_hf(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    import datasets  # heavy; only needed for these formats

    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            chosen = split or ("train" if "train" in data else None)
            if chosen not in data:
                raise ValueError(f"{path}: a DatasetDict with splits {list(data)}; pass split=<one of them>")
            data = data[chosen]
    else:
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no parquet files found")
        data = datasets.Dataset.from_parquet([str(f) for f in files])
    yield from _without_image_decoding(data)


def _without_image_decoding(data: Any) -> Any:
    """Turn off ``datasets``' lazy image decoding, so a corrupt image fails in
    ``record_to_row`` (which names the row) instead of inside the dataset iterator."""
    import datasets

    for name, feature in data.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            data = data.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(
            getattr(feature, "feature", None), datasets.Image
        ):
            data = data.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return data


def iter_records(path: str | Path, *, split: str | None = None) -> Iterator[dict[str, Any]]:
    """Raw records from a local file or folder (format from the suffix / folder contents)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(path)
    elif path.is_dir() or path.suffix == ".parquet":
        yield from _iter_hf(path, split)
    else:
        raise ValueError(f"{path}: unsupported data file; use .jsonl, .json, .parquet or a save_to_disk folder")


def load_rows(
    path: str | Path,
    *,
    schema: str = "auto",
    skip_bad_rows: bool = False,
    image_root: str | Path | None = None,
    split: str | None = None,
) -> tuple[list[Row], dict[str, Any]]:
    """Load Rows from a local dataset.

    Args:
        path: a ``.jsonl`` / ``.json`` file, a ``.parquet`` file or a folder of them, or a
            ``save_to_disk`` folder (Dataset or DatasetDict).
        schema: "auto", "row" or "geometry3k" (Geometry3K / ViRL39K / R1-VL-10K style).
        skip_bad_rows: skip and count bad rows instead of raising ``BadRowError``.
        image_root: folder that relative image paths are resolved against (default: the
            data file's folder, or the folder itself).
        split: which split of a saved DatasetDict (default "train").

    Returns:
        rows: list of validated Rows.
        stats: ``{"total", "loaded", "skipped", "errors": [messages of skipped rows]}``.
    """
    if schema not in SCHEMAS:
        raise ValueError(f"unknown schema {schema!r}; valid: {SCHEMAS}")
    path = Path(path)
    root = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    source = path.stem or "data"
    rows: list[Row] = []
    errors: list[str] = []
    seen_ids: set[str] = set()
    total = 0
    detected: str | None = None if schema == "auto" else schema
    for index, record in enumerate(iter_records(path, split=split)):
        total += 1
        try:
            if "__bad_json__" in record:
                raise BadRowError(f"{describe_row(index, None)}: invalid JSON at {record['__bad_json__']}")
            ref = describe_row(index, record.get("id"))
            if detected is None:
                try:
                    detected = _detect_schema(record.keys())
                except ValueError as exc:  # a malformed first row: name it, and try the next one
                    raise BadRowError(f"{ref}: {exc}") from exc
            missing = [f for f in ("problem", "answer", "steps", "key_steps") if f not in record]
            if detected == "row" and missing:
                raise BadRowError(f"{ref}: schema 'row' but missing {missing}")
            row = record_to_row(record, index, image_root=root, source=source)
            if row["id"] in seen_ids:
                raise BadRowError(f"{describe_row(index, row['id'])}: duplicate id")
            seen_ids.add(row["id"])
        except BadRowError as exc:
            if not skip_bad_rows:
                raise BadRowError(f"{path}: {exc}") from exc
            errors.append(str(exc))
            continue
        rows.append(row)
    if errors:
        logger.warning("%s: skipped %d of %d rows; first: %s", path, len(errors), total, errors[0])
    stats = {"total": total, "loaded": len(rows), "skipped": len(errors), "errors": errors, "schema": detected}
    return rows, stats


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
