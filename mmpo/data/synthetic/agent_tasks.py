"""Tasks where a tool must help: ``calc``, arithmetic a tiny model cannot do in its head; ``twohop``, two lookups
whose answers are padded with distractors (MATPO's testbed, docs/matpo.md).

``calc``: ``Compute 4821 * 37 - 1290.`` (difficulty 1: a 3-digit times a 2-digit number plus a 3-digit one;
2: 4-digit x 2-digit +/- 4-digit; 3: 4-digit x 3-digit +/- 5-digit). The answer is an integer (the
``accuracy`` reward checks it). Each row carries ``tool_trace``, the conversation that solves it with the
calculator (an assistant ``<tool_call>``, the tool's answer, an assistant answer in the think/answer format):
what the SFT warm-up teaches (``mmpo.algos.agent.AgentSFTModule``). Train / val / test are disjoint by the
registry's content hash.
"""

from __future__ import annotations

import json
import random
from typing import Any

from mmpo.data.synthetic.registry import register_task

# difficulty -> (first operand digits, multiplier digits, last operand digits)
_CALC_LEVELS: dict[int, tuple[int, int, int]] = {1: (3, 2, 3), 2: (4, 2, 4), 3: (4, 3, 5)}


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def calculator_trace(expression: str, value: str) -> list[dict[str, str]]:
    """The tool-use conversation after the prompt: call the calculator, read its result, answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": f"<think>The calculator gives {expression} = {value}.</think>"
                                         f"<answer>{value}</answer>"},
    ]


@register_task("calc")
def calc(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``a * b + c`` or ``a * b - c`` with multi-digit operands; answer: the integer value."""
    first, multiplier, last = _CALC_LEVELS[difficulty]
    a, b, c = _number(rng, first), _number(rng, multiplier), _number(rng, last)
    sign = rng.choice("+-")
    value = a * b + c if sign == "+" else a * b - c
    expression = f"{a} * {b} {sign} {c}"
    return {
        "images": [], "problem": f"Compute {expression}.", "answer": str(value),
        "steps": [f"{a} * {b} = {a * b}.", f"{a * b} {sign} {c} = {value}.", f"So the answer is {value}."],
        "key_steps": [[f"{a} * {b} = {a * b}"], [f"{a * b} {sign} {c} = {value}"]],
        "needs_image": False, "image_description": "There is no image.", "rationale": "I use the calculator.",
        "tool_trace": calculator_trace(expression, str(value)),
    }


_FIRST_NAMES = ("Ada", "Bram", "Cleo", "Dario", "Edda", "Femi", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena")
_LAST_NAMES = ("Abbott", "Brook", "Castell", "Drummond", "Ellery", "Frost", "Garrow", "Holt", "Ingram", "Jessop")


def lookup_trace(person: str) -> list[dict[str, str]]:
    """The single-agent conversation that solves a ``twohop`` row with the lookup tool (two calls, then the
    answer); the tool answers are the real ones, distractors included."""
    from mmpo.tools.lookup import city_of, lookup, population_of

    city = city_of(person)
    calls = [json.dumps({"name": "lookup", "arguments": {"key": key}}) for key in (f"person:{person}", f"city:{city}")]
    return [
        {"role": "assistant", "content": f"<tool_call>\n{calls[0]}\n</tool_call>"},
        {"role": "tool", "content": lookup(f"person:{person}")},
        {"role": "assistant", "content": f"<tool_call>\n{calls[1]}\n</tool_call>"},
        {"role": "tool", "content": lookup(f"city:{city}")},
        {"role": "assistant", "content": f"<think>{person} lives in {city}, which has {population_of(city)} "
                                         f"inhabitants.</think><answer>{population_of(city)}</answer>"},
    ]


@register_task("twohop")
def twohop(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """How many people live in the city where <person> lives? Two lookups (person -> city -> population), each
    answer padded with distractor records (mmpo.tools.lookup); answer: the population."""
    from mmpo.tools.lookup import city_of, population_of

    person = f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"
    city = city_of(person)
    value = str(population_of(city))
    return {
        "images": [], "problem": f"How many people live in the city where {person} lives?", "answer": value,
        "steps": [f"{person} lives in {city}.", f"{city} has {value} inhabitants.", f"So the answer is {value}."],
        "key_steps": [[city], [value]], "needs_image": False, "image_description": "There is no image.",
        "rationale": "I look the person up, then the city.", "tool_trace": lookup_trace(person),
    }
