"""A dataset row's images: the accepted values, cheap checks, and decoding to RGB PIL images.

A row's image value is one image, a list of them, or None. An image is a PIL image, an HF
``Image`` value (``{"bytes": ..., "path": ...}``), raw encoded bytes, or a file path
(relative paths are resolved against an image root).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

from mmpo.data.schema import BadRowError


def as_image_list(value: Any) -> list[Any]:
    """A row's image value as a list: None -> [], one image -> [image], a list stays."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [v for v in value if v is not None]
    return [value]


def open_image(value: Any, root: Path, ref: str) -> Image.Image:
    """One image from a PIL image, an HF Image dict, bytes, or a path (relative to root)."""
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict):
            if value.get("bytes"):
                image = Image.open(io.BytesIO(value["bytes"]))
            elif value.get("path"):
                return open_image(value["path"], root, ref)
            else:
                raise BadRowError(f"{ref}: image dict has neither 'bytes' nor 'path'")
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            path = _image_path(value, root)
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


def _image_path(value: str | Path, root: Path) -> Path:
    path = Path(value)
    return path if path.is_absolute() else root / path


def check_image_refs(values: list[Any], root: Path, ref: str) -> None:
    """Cheap checks that need no decoding: files exist, dicts hold bytes or a path, types are known."""
    for value in values:
        if isinstance(value, dict):
            if value.get("bytes"):
                continue
            if not value.get("path"):
                raise BadRowError(f"{ref}: image dict has neither 'bytes' nor 'path'")
            value = value["path"]
        if isinstance(value, (str, Path)):
            path = _image_path(value, root)
            if not path.is_file():
                raise BadRowError(f"{ref}: image file not found: {path}")
        elif not isinstance(value, (bytes, bytearray, Image.Image)):
            raise BadRowError(f"{ref}: unsupported image value of type {type(value).__name__}")
