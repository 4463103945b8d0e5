"""Synthetic geometry task for GCPO (GeometryZero, arXiv 2506.07160): ``geometry_aux``.

A triangle with its two base angles a (at A) and b (at B) printed on the image. Two kinds of
question, drawn at random per item:

- ``exterior`` (an auxiliary construction helps): the exterior angle at the apex C, between
  BC and the extension of AC beyond C (drawn dashed). Drawing a line through C parallel to AB
  splits it into a copy of a (corresponding angles) and a copy of b (alternate angles), so the
  answer is a + b in one step. The reference solution uses the construction, written as
  ``<auxiliary>...</auxiliary>`` inside the think block (the GCPO default detector).
- ``interior`` (no construction needed): the interior angle at C, 180 - a - b, by the angle
  sum. The reference solution has no construction; adding one only lengthens the reasoning.

Rows carry ``aux_helps`` (True for ``exterior``) so a benchmark can split accuracy by kind.
GCPO's group contrastive mask is meant to learn the same split from rollouts: reward the
construction where rollouts using it are more accurate, penalise it where they are less.
Importing this module registers the task with ``mmpo.data.synthetic``.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.drawing import draw_labelled_triangle
from mmpo.data.synthetic.registry import register_task

TASK_NAME = "geometry_aux"

AUXILIARY_CONSTRUCTION = "<auxiliary>Draw a line through C parallel to AB.</auxiliary>"

# difficulty -> (allowed base angles, largest sum of the two angles)
_ANGLE_LEVELS: dict[int, tuple[range, int]] = {
    1: (range(30, 81, 10), 140),
    2: (range(25, 86, 5), 150),
    3: (range(21, 90, 1), 155),
}
_LINE = (0, 0, 0)
_AUX = (120, 120, 120)
_TEXT = (20, 50, 220)

EXTERIOR_PROBLEM = (
    "Two angles of the triangle are shown. What is the exterior angle at the top vertex C, "
    "between BC and the extension of AC, in degrees?"
)
INTERIOR_PROBLEM = "Two angles of the triangle are shown. What is the interior angle at the top vertex C in degrees?"


def _exterior_solution(a: int, b: int) -> tuple[list[str], list[list[str]]]:
    steps = [
        f"The two angles are {a} and {b}.",
        AUXILIARY_CONSTRUCTION,
        f"The parallel line copies angle A ({a}) and angle B ({b}) at C.",
        f"{a} + {b} = {a + b}.",
    ]
    key_steps = [["parallel to ab", "parallel"], [f"{a} + {b} = {a + b}", f"{a}+{b}={a + b}"]]
    return steps, key_steps


def _interior_solution(a: int, b: int) -> tuple[list[str], list[list[str]]]:
    steps = [f"The two angles are {a} and {b}.", f"{a} + {b} = {a + b}.", f"180 - {a + b} = {180 - a - b}."]
    key_steps = [[f"{a} + {b} = {a + b}", f"{a}+{b}={a + b}"], [f"180 - {a + b} = {180 - a - b}"]]
    return steps, key_steps


@register_task(TASK_NAME)
def geometry_aux(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """One ``geometry_aux`` item (see the module docstring); half exterior, half interior questions."""
    choices, max_sum = _ANGLE_LEVELS[difficulty]
    while True:
        a, b = rng.choice(choices), rng.choice(choices)
        if a + b <= max_sum:
            break
    exterior = rng.random() < 0.5
    image, draw, face, ((ax, ay), _, (cx, cy)) = draw_labelled_triangle(a, b, image_size, line=_LINE, text=_TEXT)
    if exterior:
        # extension of AC beyond C, a third of AC long
        ex, ey = cx + (cx - ax) / 3, cy + (cy - ay) / 3
        draw.line([(cx, cy), (ex, ey)], fill=_AUX)
        draw.text((ex, ey), "?", fill=_TEXT, font=face, anchor="lb")
        steps, key_steps = _exterior_solution(a, b)
        answer, problem = a + b, EXTERIOR_PROBLEM
    else:
        draw.text((cx, cy - 1), "?", fill=_TEXT, font=face, anchor="mb")
        steps, key_steps = _interior_solution(a, b)
        answer, problem = 180 - a - b, INTERIOR_PROBLEM
    return {
        "images": [image],
        "problem": problem,
        "answer": str(answer),
        "steps": steps,
        "key_steps": key_steps,
        "needs_image": True,
        "aux_helps": exterior,
        "image_description": f"The image shows a triangle with angles {a} and {b}.",
        "rationale": "A line parallel to a side copies angles." if exterior else "The angles of a triangle sum to 180.",
    }
