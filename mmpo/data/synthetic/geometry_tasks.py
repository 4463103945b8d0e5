"""Triangle angle: two angles are written on the image, find the third (answer: degrees).

The numbers exist only in the image, so the task needs it. The triangle is drawn
with its true angles: A (bottom left), B (bottom right), apex C marked with '?'.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.drawing import draw_labelled_triangle
from mmpo.data.synthetic.registry import register_task

# difficulty -> (allowed base angles, largest sum of the two given angles)
_ANGLE_LEVELS: dict[int, tuple[range, int]] = {
    1: (range(30, 81, 10), 140),
    2: (range(25, 86, 5), 150),
    3: (range(21, 90, 1), 155),
}

_LINE = (0, 0, 0)
_TEXT = (20, 50, 220)


@register_task("triangle_angle")
def triangle_angle(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """The missing angle of a triangle whose other two angles are printed on the image."""
    choices, max_sum = _ANGLE_LEVELS[difficulty]
    while True:
        a, b = rng.choice(choices), rng.choice(choices)
        if a + b <= max_sum:
            break
    c = 180 - a - b
    image, draw, face, (_, _, (cx, cy)) = draw_labelled_triangle(a, b, image_size, line=_LINE, text=_TEXT)
    draw.text((cx, cy - 1), "?", fill=_TEXT, font=face, anchor="mb")
    steps = [
        f"The two angles are {a} and {b}.",
        f"{a} + {b} = {a + b}.",
        f"180 - {a + b} = {c}.",
    ]
    return {
        "images": [image],
        "problem": "Two angles of the triangle are shown. What is the missing angle in degrees?",
        "answer": str(c),
        "steps": steps,
        "key_steps": [
            [f"{a} + {b} = {a + b}", f"{a}+{b}={a + b}"],
            [f"180 - {a + b} = {c}", f"180-{a + b}={c}"],
        ],
        "needs_image": True,
        "image_description": f"The image shows a triangle with angles {a} and {b}.",
        "rationale": "The angles of a triangle sum to 180.",
    }
