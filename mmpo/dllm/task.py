"""Synthetic multi-step arithmetic with reference derivations (the dLLM text task).

A problem is a chain of operations evaluated strictly left to right, e.g. ``7+5*2-3``
means ((7+5)*2)-3. The reference trace writes one step per line and ends with the
answer line::

    7+5=12
    12*2=24
    24-3=21
    A:21

Every intermediate value stays in ``[0, max_value]`` (operations that would leave the
range are redrawn), so answers are small integers a tiny model can tokenize digit by
digit. The trace is what IGPO (arXiv 2509.10396) cuts into hint chunks, and what the
LLaDA-style SFT warm-up trains on. Difficulty grows with ``num_ops`` and ``max_operand``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OPERATORS = ("+", "-", "*")
ANSWER_PREFIX = "A:"


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Settings of the synthetic arithmetic task."""

    num_ops: int = 2
    """number of operations per problem (the derivation has this many steps)"""
    max_operand: int = 9
    """operands and the start value are drawn from 1..max_operand"""
    max_value: int = 30
    """every intermediate value stays in [0, max_value]"""

    def __post_init__(self) -> None:
        if self.num_ops < 1:
            raise ValueError(f"num_ops must be >= 1, got {self.num_ops}")
        if self.max_operand < 2:
            raise ValueError(f"max_operand must be >= 2, got {self.max_operand}")
        if self.max_value < self.max_operand:
            raise ValueError(f"max_value ({self.max_value}) must be >= max_operand ({self.max_operand})")


def apply_op(left: int, op: str, right: int) -> int:
    """``left op right`` for one of ``+ - *``."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unknown operator {op!r}; valid: {OPERATORS}")


def make_problem(rng: random.Random, config: ArithmeticTaskConfig) -> dict[str, str]:
    """Draw one problem.

    Returns:
        ``{"problem": "7+5*2-3", "trace": "7+5=12\\n...\\nA:21", "answer": "21"}``.
    """
    value = rng.randint(1, config.max_operand)
    problem = str(value)
    lines = []
    for _ in range(config.num_ops):
        while True:
            op = rng.choice(OPERATORS)
            operand = rng.randint(1, config.max_operand)
            result = apply_op(value, op, operand)
            if 0 <= result <= config.max_value:
                break
        lines.append(f"{value}{op}{operand}={result}")
        problem += f"{op}{operand}"
        value = result
    lines.append(f"{ANSWER_PREFIX}{value}")
    return {"problem": problem, "trace": "\n".join(lines), "answer": str(value)}


def solve(problem: str) -> int:
    """Evaluate a problem string left to right (used to check generated rows)."""
    import re

    tokens = re.findall(r"\d+|[+\-*]", problem)
    if not tokens or not tokens[0].isdigit():
        raise ValueError(f"malformed problem {problem!r}")
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = apply_op(value, op, int(operand))
    return value


def make_split(
    config: ArithmeticTaskConfig, size: int, seed: int, *, exclude: set[str] | None = None, prefix: str = "arith"
) -> list[dict[str, str]]:
    """``size`` distinct problems drawn with ``seed``, none of whose problem strings is in ``exclude``.

    Each row: ``id``, ``problem``, ``trace``, ``answer``.
    """
    rng = random.Random(seed)
    exclude = exclude or set()
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < size:
        attempts += 1
        if attempts > 100 * size + 1000:
            raise ValueError(
                f"could not draw {size} distinct problems with {config}; lower the size or raise num_ops/max_operand"
            )
        row = make_problem(rng, config)
        if row["problem"] in seen or row["problem"] in exclude:
            continue
        seen.add(row["problem"])
        rows.append({"id": f"{prefix}-{seed}-{len(rows)}", **row})
    return rows


def make_train_and_test(
    config: ArithmeticTaskConfig, train_size: int, test_size: int, seed: int = 0
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A held-out test split and a train split disjoint from it (by problem string)."""
    test = make_split(config, test_size, seed=10_000 + seed, prefix="arith-test")
    train = make_split(config, train_size, seed=seed, exclude={r["problem"] for r in test}, prefix="arith-train")
    return train, test


def corpus(config: ArithmeticTaskConfig, size: int = 2000, seed: int = 12345) -> list[str]:
    """Texts to train the tokenizer on: problems and their traces."""
    rng = random.Random(seed)
    texts = []
    for _ in range(size):
        row = make_problem(rng, config)
        texts.append(row["problem"] + "\n" + row["trace"])
    return texts
