"""``strategy_mix``: a multi-strategy text task for the TAPO testbed (docs/prompt_space.md, "TAPO testbed").

Every problem reads ``Values: v1 v2 ... vn. Find the key value.`` with n distinct digits 1-9; the question is
the same for every problem. Which value is "key" depends on the problem's family, told only by how many values
it lists (difficulty 1: 4 values, the largest; 2: 5 values, the smallest; 3: 6 values, the last one). Only the
family's procedure gives the answer: every other procedure of :data:`PROCEDURES` (the first, the second, the last,
the largest, the smallest value) gives another value, so no procedure is right by coincidence (a policy that
copies the first value is always wrong). A policy must find each family's procedure; nothing in the problem
names it.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Sequence

from mmpo.data.synthetic.registry import register_task

#: the procedures a problem's answer can follow: name -> function of the listed values
PROCEDURES: dict[str, Callable[[Sequence[int]], int]] = {
    "first": lambda values: values[0],
    "second": lambda values: values[1],
    "last": lambda values: values[-1],
    "largest": max,
    "smallest": min,
}
#: family (the item's difficulty) -> (number of values, the procedure that gives its answer)
FAMILIES: dict[int, tuple[int, str]] = {1: (4, "largest"), 2: (5, "smallest"), 3: (6, "last")}
QUESTION = "Find the key value."
_VALUES = re.compile(r"Values: ([\d ]+)\.")


def strategy_problem(values: Sequence[int]) -> str:
    return f"Values: {' '.join(str(v) for v in values)}. {QUESTION}"


def problem_values(problem: str) -> list[int]:
    """The listed values of a ``strategy_mix`` problem (also inside a longer prompt, e.g. after a template)."""
    found = _VALUES.search(problem)
    if found is None:
        raise ValueError(f"not a strategy_mix problem: {problem!r}")
    return [int(v) for v in found.group(1).split()]


def family_of(values: Sequence[int]) -> int:
    """The family of a problem with these values (by their count)."""
    for family, (count, _) in FAMILIES.items():
        if len(values) == count:
            return family
    raise ValueError(f"no strategy_mix family lists {len(values)} values")


def apply_procedure(name: str, values: Sequence[int]) -> int:
    if name not in PROCEDURES:
        raise ValueError(f"unknown procedure {name!r}; known: {sorted(PROCEDURES)}")
    return PROCEDURES[name](values)


@register_task("strategy_mix")
def strategy_mix(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """A ``strategy_mix`` problem of family ``difficulty`` (module doc). Answer: a digit."""
    count, procedure = FAMILIES[difficulty]
    while True:
        values = rng.sample(range(1, 10), count)
        answer = apply_procedure(procedure, values)
        if all(apply_procedure(other, values) != answer for other in PROCEDURES if other != procedure):
            break
    listed = ", ".join(str(v) for v in values)
    rule = f"{count} values: take the {procedure} value"
    return {"images": [], "problem": strategy_problem(values), "answer": str(answer),
            "steps": [f"The values are {listed}.", f"With {rule}.", f"So the answer is {answer}."],
            "key_steps": [[rule]], "needs_image": False, "image_description": "There is no image.",
            "rationale": f"A problem with {count} values asks for the {procedure} value."}
