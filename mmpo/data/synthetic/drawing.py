"""Small PIL drawing helpers shared by the synthetic tasks.

Images are tiny (default 56 x 56) and high-contrast so a tiny vision tower can
learn them. Objects sit in a grid of 14-pixel cells: Qwen-VL's patch size is 14,
so each patch holds at most one whole object (and PAPO's 14 x 14 masking hides
whole objects).
"""

from __future__ import annotations

import math
import random

from PIL import Image, ImageDraw, ImageFont

PATCH = 14
"""Cell size in pixels (Qwen-VL vision patch size)."""

BACKGROUND = (255, 255, 255)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "blue": (20, 50, 220),
    "green": (20, 160, 40),
    "purple": (140, 30, 190),
    "orange": (250, 130, 0),
}
"""Saturated, mutually distinct colours (all readable on white)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
)


def number_forms(value: int) -> list[str]:
    """Equivalent spellings of a small integer, digits first (e.g. ``["3", "three"]``)."""
    forms = [str(value)]
    if 0 <= value < len(NUMBER_WORDS):
        forms.append(NUMBER_WORDS[value])
    return forms


def new_canvas(image_size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A white RGB square canvas and its drawing context."""
    if image_size < 2 * PATCH:
        raise ValueError(f"image_size must be at least {2 * PATCH} pixels, got {image_size}")
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    return image, ImageDraw.Draw(image)


def grid_cells(image_size: int) -> int:
    """Number of grid cells per side (one cell per 14-pixel patch)."""
    return max(2, image_size // PATCH)


def cell_box(image_size: int, col: int, row: int) -> tuple[float, float, float, float]:
    """Pixel box (x0, y0, x1, y1) of grid cell (col, row)."""
    size = image_size / grid_cells(image_size)
    return col * size, row * size, (col + 1) * size, (row + 1) * size


def draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    box: tuple[float, float, float, float],
    color: tuple[int, int, int],
    scale: float = 0.8,
) -> None:
    """Draw a filled shape centred in ``box``, its side ``scale`` x the box side."""
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    half = min(x1 - x0, y1 - y0) * scale / 2
    bounds = [cx - half, cy - half, cx + half, cy + half]
    if shape == "circle":
        draw.ellipse(bounds, fill=color)
    elif shape == "square":
        draw.rectangle(bounds, fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}; valid: {SHAPES}")


def sample_cells(rng: random.Random, image_size: int, k: int) -> list[tuple[int, int]]:
    """``k`` distinct (col, row) grid cells chosen uniformly."""
    n = grid_cells(image_size)
    if k > n * n:
        raise ValueError(f"cannot place {k} objects in a {n}x{n} grid (image_size={image_size})")
    return [(i % n, i // n) for i in rng.sample(range(n * n), k)]


def font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's bundled font at ``size`` pixels (no system fonts needed)."""
    return ImageFont.load_default(size=size)


def triangle_vertices(
    angle_a: float, angle_b: float, image_size: int, margin: float
) -> list[tuple[float, float]]:
    """Vertices A (bottom left), B (bottom right), C (apex) of a triangle with the given
    base angles (degrees), scaled to fit ``image_size`` minus ``margin`` on each side."""
    a, b = math.radians(angle_a), math.radians(angle_b)
    # Base AB of length 1; apex from the law of sines.
    ac = math.sin(b) / math.sin(a + b)
    cx, cy = ac * math.cos(a), ac * math.sin(a)
    xs, ys = [0.0, 1.0, cx], [0.0, 0.0, cy]
    width, height = max(xs) - min(xs), max(ys) - min(ys)
    span = image_size - 2 * margin
    scale = span / max(width, height)
    x_off = margin + (span - width * scale) / 2 - min(xs) * scale
    y_base = image_size - margin - (span - height * scale) / 2
    return [(x_off + x * scale, y_base - y * scale) for x, y in zip(xs, ys)]


def draw_labelled_triangle(
    angle_a: int, angle_b: int, image_size: int, *, line: tuple[int, int, int], text: tuple[int, int, int]
) -> tuple[Image.Image, ImageDraw.ImageDraw, ImageFont.ImageFont | ImageFont.FreeTypeFont, list[tuple[float, float]]]:
    """A new canvas with triangle ABC whose base angles A and B are written beside their vertices.

    Returns the image, its drawing context, the label font and the vertices [A, B, C] (room is
    left under the base and above the apex so callers can add their own labels there).
    """
    image, draw = new_canvas(image_size)
    text_size = max(9, image_size // 5)
    face = font(text_size)
    margin = text_size * 0.9
    (ax, ay), (bx, by), (cx, cy) = triangle_vertices(angle_a, angle_b, image_size, margin)
    ay -= text_size * 0.6
    by -= text_size * 0.6
    cy = max(cy, text_size * 1.0)
    draw.polygon([(ax, ay), (bx, by), (cx, cy)], outline=line)
    draw.text((ax, ay + 1), str(angle_a), fill=text, font=face, anchor="lt")
    draw.text((bx, by + 1), str(angle_b), fill=text, font=face, anchor="rt")
    return image, draw, face, [(ax, ay), (bx, by), (cx, cy)]
