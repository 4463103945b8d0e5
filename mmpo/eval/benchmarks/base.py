"""A named benchmark read from local files: its layout, how a record becomes a Row, and its rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mmpo.eval.benchmarks.files import Layout, decode_image, image_source, locate_files, read_records

Row = dict[str, Any]
RowBuilder = Callable[[Mapping[str, Any], int], "Row | None"]


@dataclass(frozen=True)
class LocalBenchmark:
    """A benchmark whose items come from the publisher's files under ``--data-dir``.

    Attributes:
        name: registry name (e.g. ``mathvista_testmini``).
        layout: folder, split and required columns.
        build_row: ``(publisher record, its index)`` -> a Row (with ``scoring``), or None to leave the record out
            (e.g. MMMU's open questions in ``mmmu_val``).
        modality: ``"vlm"`` or ``"dllm"`` (text benchmarks for masked-diffusion checkpoints).
        description: one line for ``mmpo eval --list``.
    """

    name: str
    layout: Layout
    build_row: RowBuilder
    modality: str = "vlm"
    description: str = ""

    def expects(self) -> str:
        return self.layout.expects()

    def check_files(self, data_dir: str | Path | None) -> None:
        """Fail now (before a model loads) when the files are absent; names benchmark, path and layout."""
        locate_files(self.name, data_dir, self.layout)

    def load(self, data_dir: str | Path) -> list[Row]:
        """Every kept record as a Row (images still undecoded, see :func:`decode_row_images`)."""
        root, records = read_records(self.name, data_dir, self.layout)
        rows = []
        for index, record in enumerate(records):
            row = self.build_row(record, index)
            if row is not None:
                row["image_root"] = str(root)
                rows.append(row)
        if not rows:
            raise ValueError(f"benchmark {self.name!r}: no usable items in {root}")
        return rows


def make_row(*, item_id: Any, task: str, prompt: str, images: Sequence[Any], answer: Any,
             scoring: Mapping[str, Any]) -> Row:
    """A contract Row for eval: ``problem`` is the full prompt, ``images`` undecoded, ``scoring`` the rule."""
    images = [image for image in images if image is not None]
    return {
        "id": str(item_id), "task": task, "images": images, "problem": prompt, "answer": str(answer),
        "steps": [], "key_steps": [], "expert_trace": None, "difficulty": 1, "needs_image": bool(images),
        "image_sources": [image_source(image, index) for index, image in enumerate(images)],
        "scoring": dict(scoring),
    }


def decode_row_images(row: Row) -> Row:
    """``row`` with its images decoded to RGB PIL images (a copy; rows without ``image_root`` pass through)."""
    if "image_root" not in row:
        return row
    root = Path(row["image_root"])
    try:
        images = [decode_image(image, root) for image in row["images"]]
    except (OSError, ValueError) as error:
        raise ValueError(f"item {row['id']!r}: cannot read its image: {error}") from error
    return {**row, "images": images}


def options_block(options: Sequence[str]) -> str:
    """``(A) first\\n(B) second ...``: how MMMU and MathVision list the options."""
    return "\n".join(f"({chr(ord('A') + index)}) {option}" for index, option in enumerate(options))
