"""Text-solvable control task: small additions (needs_image False, no image).

Useful to check that vision-specific methods (PAPO's perception KL) leave
text-only prompts alone.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.registry import register_task

# difficulty -> (first operand range, second operand range)
_ADD_LEVELS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    1: ((1, 9), (1, 9)),
    2: ((10, 49), (1, 9)),
    3: ((10, 99), (10, 99)),
}


@register_task("arithmetic")
def arithmetic(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """What is a + b (answer: an integer); text only."""
    (a_lo, a_hi), (b_lo, b_hi) = _ADD_LEVELS[difficulty]
    a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
    return {
        "images": [],
        "problem": f"What is {a} + {b}?",
        "answer": str(a + b),
        "steps": [f"{a} + {b} = {a + b}.", f"So the answer is {a + b}."],
        "key_steps": [[f"{a} + {b} = {a + b}", f"{a}+{b}={a + b}"]],
        "needs_image": False,
        "image_description": "There is no image.",
        "rationale": "I add the two numbers.",
    }
