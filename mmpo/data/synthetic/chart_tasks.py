"""Bar chart reading: the value of the bar of a named colour (answer: an integer).

Bars stand on a baseline with light grid lines at every integer, so the value is
the number of grid steps the bar reaches.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.drawing import COLORS, new_canvas, number_forms
from mmpo.data.synthetic.registry import register_task

# difficulty -> (number of bars, maximum value)
_BAR_LEVELS: dict[int, tuple[int, int]] = {1: (2, 4), 2: (3, 6), 3: (4, 9)}

_GRID_COLOR = (200, 200, 200)
_AXIS_COLOR = (0, 0, 0)


@register_task("bar_chart")
def bar_chart(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Read the value of one bar in a small bar chart."""
    n_bars, vmax = _BAR_LEVELS[difficulty]
    names = rng.sample(list(COLORS), n_bars)
    values = [rng.randint(1, vmax) for _ in names]
    asked = rng.randrange(n_bars)
    image, draw = new_canvas(image_size)
    top, bottom = 3, image_size - 3
    unit = (bottom - top) / vmax
    for v in range(1, vmax + 1):
        y = round(bottom - v * unit)
        draw.line([(0, y), (image_size - 1, y)], fill=_GRID_COLOR)
    column = image_size / n_bars
    for k, (name, value) in enumerate(zip(names, values)):
        x0 = k * column + 0.2 * column
        x1 = (k + 1) * column - 0.2 * column
        draw.rectangle([x0, round(bottom - value * unit), x1, bottom], fill=COLORS[name])
    draw.line([(0, bottom), (image_size - 1, bottom)], fill=_AXIS_COLOR)
    name, value = names[asked], values[asked]
    steps = [
        f"There are {n_bars} bars.",
        f"The {name} bar reaches line {value}.",
        f"So its value is {value}.",
    ]
    return {
        "images": [image],
        "problem": f"What is the value of the {name} bar?",
        "answer": str(value),
        "steps": steps,
        "key_steps": [
            [f"{w} bars" for w in number_forms(n_bars)],
            [f"{name} bar reaches line {value}", f"value is {value}"],
        ],
        "needs_image": True,
        "image_description": f"The image shows a bar chart with {n_bars} bars and grid lines.",
        "rationale": f"I read the height of the {name} bar.",
    }
