"""Shape tasks: count shapes of a colour, position in the image, relative position, compare sizes.

All four need the image (the question names colours only, never positions or
counts). Difficulty scales the number of objects and colours, and for
``compare_size`` shrinks the size gap.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.drawing import (
    COLORS,
    SHAPES,
    cell_box,
    draw_shape,
    grid_cells,
    new_canvas,
    number_forms,
    sample_cells,
)
from mmpo.data.synthetic.registry import register_task

def _plural(noun: str, count: int) -> str:
    return noun if count == 1 else noun + "s"


# difficulty -> (target count range, distractor count range, number of colours)
_COUNT_LEVELS: dict[int, tuple[tuple[int, int], tuple[int, int], int]] = {
    1: ((1, 3), (0, 2), 2),
    2: ((1, 5), (1, 3), 3),
    3: ((2, 7), (2, 5), 4),
}


@register_task("count_shapes")
def count_shapes(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """How many shapes of one colour are in the image (answer: a small integer)."""
    (t_lo, t_hi), (d_lo, d_hi), n_colors = _COUNT_LEVELS[difficulty]
    colors = rng.sample(list(COLORS), n_colors)
    target, others = colors[0], colors[1:]
    n_target = rng.randint(t_lo, t_hi)
    n_distract = rng.randint(d_lo, d_hi)
    image, draw = new_canvas(image_size)
    object_colors = [target] * n_target + [rng.choice(others) for _ in range(n_distract)]
    for color, (col, row) in zip(object_colors, sample_cells(rng, image_size, len(object_colors))):
        draw_shape(draw, rng.choice(SHAPES), cell_box(image_size, col, row), COLORS[color])
    total = len(object_colors)
    steps = [
        f"The image shows {total} {_plural('shape', total)}.",
        f"{n_target} of them {'is' if n_target == 1 else 'are'} {target}.",
        f"So the answer is {n_target}.",
    ]
    return {
        "images": [image],
        "problem": f"How many {target} shapes are in the image?",
        "answer": str(n_target),
        "steps": steps,
        "key_steps": [
            [f"{w} {_plural('shape', total)}" for w in number_forms(total)],
            [f"{w} of them {'is' if n_target == 1 else 'are'} {target}" for w in number_forms(n_target)]
            + [f"{n_target} {target}"],
        ],
        "needs_image": True,
        "image_description": f"The image shows {total} shapes in {len(set(object_colors))} colours.",
        "rationale": f"I count the {target} shapes.",
    }


# difficulty -> (distractor count range, axes the question may ask about, pair in opposite halves)
# Level 1 puts the two shapes in opposite halves of the image, so "left of" coincides with
# "in the left half". The task stays hard for small models all the same (it needs the word
# order, colour binding and a position comparison; see bench/RESULTS.md (section data)):
# ``shape_position`` below is the easy variant.
_POSITION_LEVELS: dict[int, tuple[tuple[int, int], tuple[str, ...], bool]] = {
    1: ((0, 0), ("horizontal",), True),
    2: ((1, 2), ("horizontal",), False),
    3: ((2, 4), ("horizontal", "vertical"), False),
}


@register_task("relative_position")
def relative_position(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Is shape A left/right (or above/below) of shape B (answer: one word)."""
    (d_lo, d_hi), axes, opposite_halves = _POSITION_LEVELS[difficulty]
    axis = rng.choice(axes)
    first, second, *others = rng.sample(list(COLORS), len(COLORS))
    n_distract = rng.randint(d_lo, d_hi)
    index = 0 if axis == "horizontal" else 1
    half = grid_cells(image_size) / 2
    while True:
        cells = sample_cells(rng, image_size, 2 + n_distract)
        a, b = cells[0][index], cells[1][index]
        if a != b and (not opposite_halves or (a < half) != (b < half)):
            break
    image, draw = new_canvas(image_size)
    colors = [first, second] + [rng.choice(others) for _ in range(n_distract)]
    for color, (col, row) in zip(colors, cells):
        draw_shape(draw, rng.choice(SHAPES), cell_box(image_size, col, row), COLORS[color])
    (c1, r1), (c2, r2) = cells[0], cells[1]
    if axis == "horizontal":
        unit, p1, p2 = "column", c1 + 1, c2 + 1
        answer = "left" if c1 < c2 else "right"
        problem = f"Is the {first} shape left or right of the {second} shape?"
    else:
        unit, p1, p2 = "row", r1 + 1, r2 + 1
        answer = "above" if r1 < r2 else "below"
        problem = f"Is the {first} shape above or below the {second} shape?"
    steps = [
        f"The {first} shape is in {unit} {p1}.",
        f"The {second} shape is in {unit} {p2}.",
        f"So the {first} shape is {answer} of the {second} shape."
        if axis == "horizontal"
        else f"So the {first} shape is {answer} the {second} shape.",
    ]
    return {
        "images": [image],
        "problem": problem,
        "answer": answer,
        "steps": steps,
        "key_steps": [[f"{first} shape is in {unit} {p1}"], [f"{second} shape is in {unit} {p2}"]],
        "needs_image": True,
        "image_description": f"The image shows {len(colors)} shapes.",
        "rationale": f"I compare the {unit}s of the {first} and {second} shapes.",
    }


# difficulty -> (distractor count range, axes the question may ask about)
_ABSOLUTE_LEVELS: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {
    1: ((0, 0), ("horizontal",)),
    2: ((1, 2), ("horizontal",)),
    3: ((2, 4), ("horizontal", "vertical")),
}
_HALF_WORDS = {"horizontal": ("left", "right"), "vertical": ("top", "bottom")}


@register_task("shape_position")
def shape_position(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Which half of the image a coloured shape is in (answer: left/right, or top/bottom at level 3).

    The easy position task: level 1 shows a single shape; higher levels add distractors.
    """
    (d_lo, d_hi), axes = _ABSOLUTE_LEVELS[difficulty]
    axis = rng.choice(axes)
    target, *others = rng.sample(list(COLORS), len(COLORS))
    n_distract = rng.randint(d_lo, d_hi)
    n = grid_cells(image_size)
    index = 0 if axis == "horizontal" else 1
    while True:
        cells = sample_cells(rng, image_size, 1 + n_distract)
        if 2 * cells[0][index] + 1 != n:  # not the middle line of an odd grid
            break
    image, draw = new_canvas(image_size)
    colors = [target] + [rng.choice(others) for _ in range(n_distract)]
    for color, (col, row) in zip(colors, cells):
        draw_shape(draw, rng.choice(SHAPES), cell_box(image_size, col, row), COLORS[color])
    unit = "column" if axis == "horizontal" else "row"
    position = cells[0][index] + 1
    low, high = _HALF_WORDS[axis]
    answer = low if 2 * position <= n else high
    problem = (f"Is the {target} shape on the left or the right?" if axis == "horizontal"
               else f"Is the {target} shape at the top or the bottom?")
    steps = [
        f"The {target} shape is in {unit} {position} of {n}.",
        f"So it is {'on the' if axis == 'horizontal' else 'at the'} {answer}.",
    ]
    return {
        "images": [image],
        "problem": problem,
        "answer": answer,
        "steps": steps,
        "key_steps": [[f"{target} shape is in {unit} {position}"]],
        "needs_image": True,
        "image_description": f"The image shows {len(colors)} {_plural('shape', len(colors))}.",
        "rationale": f"I find the {unit} of the {target} shape.",
    }


# difficulty -> (scale of the smaller shape, distractor count range); the larger has scale 0.95.
_SIZE_LEVELS: dict[int, tuple[float, tuple[int, int]]] = {
    1: (0.45, (0, 0)),
    2: (0.6, (1, 2)),
    3: (0.7, (2, 4)),
}


@register_task("compare_size")
def compare_size(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Which of two coloured shapes is bigger (answer: a colour word)."""
    small_scale, (d_lo, d_hi) = _SIZE_LEVELS[difficulty]
    first, second, *others = rng.sample(list(COLORS), len(COLORS))
    big, small = (first, second) if rng.random() < 0.5 else (second, first)
    n_distract = rng.randint(d_lo, d_hi)
    image, draw = new_canvas(image_size)
    colors = [first, second] + [rng.choice(others) for _ in range(n_distract)]
    cells = sample_cells(rng, image_size, len(colors))
    shape = rng.choice(SHAPES)  # the compared pair share a shape so only size differs
    for k, (color, (col, row)) in enumerate(zip(colors, cells)):
        if k < 2:
            scale = 0.95 if color == big else small_scale
            draw_shape(draw, shape, cell_box(image_size, col, row), COLORS[color], scale)
        else:
            draw_shape(draw, rng.choice(SHAPES), cell_box(image_size, col, row), COLORS[color],
                       rng.choice((small_scale, 0.95)))
    steps = [
        f"The {big} shape is large.",
        f"The {small} shape is small.",
        f"So the {big} shape is bigger.",
    ]
    return {
        "images": [image],
        "problem": f"Which shape is bigger, the {first} one or the {second} one?",
        "answer": big,
        "steps": steps,
        "key_steps": [[f"{big} shape is large"], [f"{small} shape is small"]],
        "needs_image": True,
        "image_description": f"The image shows {len(colors)} shapes.",
        "rationale": f"I compare the sizes of the {first} and {second} shapes.",
    }
