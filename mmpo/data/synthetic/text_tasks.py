"""Text-solvable control task: small additions (needs_image False, no image).

Useful to check that vision-specific methods (PAPO's perception KL) leave
text-only prompts alone.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.drawing import COLORS
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


# ---------------------------------------------------------------------------------------------------------
# Text-only reasoning tasks for text LMs (``TEXT_TASKS``): every answer is an integer or an arithmetic
# expression that math-verify checks (``mmpo.rewards.builtin.accuracy_reward``).

def _text_row(problem: str, answer: str, steps: list[str], key_steps: list[list[str]], **extra: Any) -> dict[str, Any]:
    return {"images": [], "problem": problem, "answer": answer, "steps": steps, "key_steps": key_steps,
            "needs_image": False, "image_description": "There is no image.",
            "rationale": "I work it out step by step.", **extra}


# difficulty -> (operand digits, operators)
_LONG_ARITH_LEVELS: dict[int, tuple[int, tuple[str, ...]]] = {1: (2, ("+", "-")), 2: (3, ("+", "-")),
                                                               3: (2, ("+", "-", "*"))}


@register_task("long_arithmetic")
def long_arithmetic(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Multi-digit arithmetic with three operands, evaluated left to right in two steps (``*`` binds first:
    difficulty 3 puts any product first, so left to right is also the usual order). Answer: an integer."""
    digits, operators = _LONG_ARITH_LEVELS[difficulty]
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b, c = (rng.randint(low, high) for _ in range(3))
    first = rng.choice(operators)
    second = rng.choice([op for op in operators if op != "*"])
    if first == "*":
        b = rng.randint(2, 9)
    partial = {"+": a + b, "-": a - b, "*": a * b}[first]
    total = partial + c if second == "+" else partial - c
    return _text_row(
        f"Compute {a} {first} {b} {second} {c}.", str(total),
        [f"{a} {first} {b} = {partial}.", f"{partial} {second} {c} = {total}.", f"So the answer is {total}."],
        [[f"{a} {first} {b} = {partial}", f"{a}{first}{b}={partial}"],
         [f"{partial} {second} {c} = {total}", f"{partial}{second}{c}={total}"]],
    )


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana")
_ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards")


@register_task("word_problem")
def word_problem(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """A multi-step word problem (difficulty = number of steps after the start: 1, 2 or 3): someone has
    some items, buys packs, gives some away, then shares the rest equally. Answer: an integer."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    start = rng.randint(5, 40)
    packs, per_pack = rng.randint(2, 6), rng.randint(2, 12)
    sentences = [f"{name} has {start} {item}."]
    steps: list[str] = []
    key_steps: list[list[str]] = []
    total = start + packs * per_pack
    sentences.append(f"{name} buys {packs} packs of {per_pack} {item} each.")
    steps.append(f"{name} buys {packs} * {per_pack} = {packs * per_pack} {item}, so has {start} + "
                 f"{packs * per_pack} = {total}.")
    key_steps.append([f"{start} + {packs * per_pack} = {total}", f"{start}+{packs * per_pack}={total}"])
    friends = rng.randint(2, 5) if difficulty >= 3 else 1
    if difficulty >= 2:
        # difficulty 3: what is left after giving away is shared equally by ``friends``, so it is a multiple
        given = rng.choice([g for g in range(1, total) if (total - g) % friends == 0])
        sentences.append(f"Then {name} gives {given} {item} away.")
        steps.append(f"After giving {given} away: {total} - {given} = {total - given}.")
        key_steps.append([f"{total} - {given} = {total - given}", f"{total}-{given}={total - given}"])
        total -= given
    if difficulty >= 3:
        sentences.append(f"{name} shares the rest equally among {friends} friends.")
        steps.append(f"Each friend gets {total} / {friends} = {total // friends}.")
        key_steps.append([f"{total} / {friends} = {total // friends}", f"{total}/{friends}={total // friends}"])
        total //= friends
        question = f"How many {item} does each friend get?"
    else:
        question = f"How many {item} does {name} have now?"
    steps.append(f"So the answer is {total}.")
    return _text_row(" ".join(sentences) + " " + question, str(total), steps, key_steps)


_COUNTDOWN_OPS = ("+", "-", "*")


def _evaluate(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@register_task("countdown")
def countdown(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """A countdown-style target puzzle: reach ``target`` with the given numbers, each used exactly once, and
    +, -, * (difficulty 1: two numbers, 2: three, 3: four). The answer is an expression; any expression that
    uses exactly these numbers and equals the target is right (``row["numbers"]``, checked by
    ``mmpo.rewards.builtin.accuracy_reward``; its value by math-verify)."""
    count = difficulty + 1
    numbers = [rng.randint(1, 12) for _ in range(count)]
    while True:  # a positive target
        ops = [rng.choice(_COUNTDOWN_OPS) for _ in range(count - 1)]
        value = numbers[0]
        for op, number in zip(ops, numbers[1:]):
            value = _evaluate(value, op, number)
        if value > 0:
            break
    value, expression = numbers[0], str(numbers[0])
    steps = []
    for op, number in zip(ops, numbers[1:]):
        new = _evaluate(value, op, number)
        steps.append(f"{value} {op} {number} = {new}.")
        expression = f"({expression}) {op} {number}" if op == "*" and " " in expression else f"{expression} {op} {number}"
        value = new
    shown = sorted(numbers)
    steps.append(f"So {expression} = {value}.")
    return _text_row(
        f"Using the numbers {', '.join(map(str, shown))}, each exactly once, and +, - and *, make {value}. "
        "Give the expression.", expression, steps, [[s.rstrip(".")] for s in steps[:-1]],
        numbers=shown, target=value,
    )


# ---------------------------------------------------------------------------------------------------------
# A text lookup task the tiny text LM learns (``TEXT_TEACHER_TASKS``): the text quickstart's abstaining-teacher
# evidence (``mmpo.data.demonstrations``; docs/llm.md). The question comes first and names one colour, so the
# teacher's colour rule (``asked_colour``: the first colour word) reads the asked colour.

_INVENTORY_COLOURS = tuple(COLORS)  # red, blue, green, purple, orange


def _listing(parts: list[str]) -> str:
    return ", ".join(parts[:-1]) + " and " + parts[-1]


@register_task("inventory")
def inventory(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """How many items of one colour someone has, read from a list of ``difficulty + 1`` colours (2, 3 or 4) with
    distinct counts 1-20; the question comes first. Answer: an integer."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    colours = rng.sample(_INVENTORY_COLOURS, difficulty + 1)
    counts = rng.sample(range(1, 21), difficulty + 1)
    asked = rng.randrange(len(colours))
    colour, count = colours[asked], counts[asked]
    listed = _listing([f"{n} {c} {item}" for n, c in zip(counts, colours)])
    return _text_row(
        f"How many {colour} {item} does {name} have? {name} has {listed}.", str(count),
        [f"{name} has {count} {colour} {item}.", f"So the answer is {count}."],
        [[f"{count} {colour} {item}"]],
    )
