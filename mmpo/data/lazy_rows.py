"""Row sequences whose images are decoded when a row is read, not when the dataset is loaded.

``LazyImageRows`` holds each row's text fields and a reference to its images (file paths,
or a memory-mapped HF ``datasets`` column of encoded bytes). Reading ``rows[i]`` returns a
complete Row with decoded PIL images; nothing is cached, so memory holds only the batches
in flight. A DataLoader reads its rows per batch, so images are decoded per batch (in the
worker processes when ``num_workers > 0``).

``ConcatRows`` chains several row sequences (synthetic rows + a local dataset) without
copying or decoding them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

from mmpo.data.images import as_image_list, open_image
from mmpo.data.schema import BadRowError, Row, describe_row


class HFImageColumn(Sequence):
    """The raw (undecoded) image values of one column of an HF ``Dataset``, read by position.

    The dataset stays memory-mapped on disk; ``column[k]`` reads row ``positions[k]`` only.
    """

    def __init__(self, table: Any, column: str, positions: list[int]) -> None:
        self.table = table.select_columns([column])
        self.column = column
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k: int) -> Any:  # type: ignore[override]
        return self.table[self.positions[k]][self.column]


class LazyImageRows(Sequence):
    """Rows whose ``images`` are decoded on access.

    Args:
        rows: each row's fields except ``images`` (validated already).
        images: ``images[k]`` is row k's raw image value(s): paths, bytes, ``{"bytes", "path"}``.
        image_root: folder relative image paths are resolved against.
        source: the dataset path, named in decoding errors.
        row_numbers: each row's index in the source file, named in errors (default 0, 1, ...).
        indices: positions in ``rows`` this view shows (slicing makes views; default all).
    """

    def __init__(self, rows: list[dict[str, Any]], images: Sequence[Any], *, image_root: Path, source: str,
                 row_numbers: list[int] | None = None, indices: range | list[int] | None = None) -> None:
        if len(rows) != len(images):
            raise ValueError(f"{len(rows)} rows but {len(images)} image entries")
        self._rows, self._images = rows, images
        self._row_numbers = list(range(len(rows))) if row_numbers is None else row_numbers
        self.image_root, self.source = image_root, source
        self._indices = range(len(rows)) if indices is None else indices

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> Row: ...

    @overload
    def __getitem__(self, index: slice) -> LazyImageRows: ...

    def __getitem__(self, index: int | slice) -> Row | LazyImageRows:
        if isinstance(index, slice):
            return LazyImageRows(self._rows, self._images, image_root=self.image_root, source=self.source,
                                 row_numbers=self._row_numbers, indices=self._indices[index])
        position = self._indices[index]
        row: Row = dict(self._rows[position])  # type: ignore[assignment]
        row["images"] = self.decode(position, row.get("id"))
        return row

    def image_count(self, index: int) -> int:
        """Images of row ``index`` without decoding them."""
        return len(as_image_list(self._images[self._indices[index]]))

    def decode(self, position: int, row_id: Any) -> list:
        """Decode the images of row ``position`` (raises ``BadRowError`` naming the file and row)."""
        ref = describe_row(self._row_numbers[position], row_id)
        try:
            return [open_image(value, self.image_root, ref) for value in as_image_list(self._images[position])]
        except BadRowError as exc:
            raise BadRowError(f"{self.source}: {exc}") from exc


class ConcatRows(Sequence):
    """Several row sequences read as one, in order, without copying (or decoding) them."""

    def __init__(self, parts: Sequence[Sequence[Row]]) -> None:
        self.parts = [part for part in parts if len(part)]
        self._ends: list[int] = []
        total = 0
        for part in self.parts:
            total += len(part)
            self._ends.append(total)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> Row:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]  # type: ignore[return-value]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row index {index} out of range for {len(self)} rows")
        part = bisect.bisect_right(self._ends, index)
        start = self._ends[part - 1] if part else 0
        return self.parts[part][index - start]
