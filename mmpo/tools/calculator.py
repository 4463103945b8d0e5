"""A calculator tool: arithmetic expressions evaluated over Python's ``ast``, never ``eval``.

Only numbers, ``+ - * / // % **``, unary signs, parentheses and a few named functions and
constants (:data:`FUNCTIONS`, :data:`CONSTANTS`) are accepted; anything else (a name, an attribute,
a call of anything else, a string) is refused with a short message. Integer and rational
arithmetic is exact (``fractions.Fraction``): ``7 / 2`` is ``3.5``, ``6 / 3`` is ``2``. Exponents
are bounded (:data:`MAX_EXPONENT`) and so are results (:data:`MAX_DIGITS`), so an expression cannot
make the tool run for long or allocate without bound.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from typing import Callable, Union

Number = Union[Fraction, float]

MAX_EXPONENT = 1000
"""Largest absolute exponent of ``**``."""
MAX_DIGITS = 1000
"""Largest number of digits of an intermediate integer result."""
MAX_EXPRESSION_CHARS = 500
"""Longest expression accepted."""

FUNCTIONS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "abs": abs, "round": round, "floor": math.floor,
    "ceil": math.ceil, "min": min, "max": max,
}
"""Named functions an expression may call."""
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the model)."""


def _check_size(value: Number) -> Number:
    if isinstance(value, Fraction):
        for part in (value.numerator, value.denominator):
            if part and math.log10(abs(part)) >= MAX_DIGITS:
                raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    elif not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        if base.numerator and abs(exponent) * math.log10(max(abs(base.numerator), abs(base.denominator))) >= MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        return base ** int(exponent)
    result = float(base) ** float(exponent)
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number")
    return result


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value) if isinstance(node.value, int) else float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        operation = _BINARY.get(type(node.op))
        if operation is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(left, float) or isinstance(right, float):
            left, right = float(left), float(right)
        return _check_size(operation(left, right))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        function = FUNCTIONS.get(node.func.id)
        if function is None:
            raise CalculatorError(f"unknown function {node.func.id!r}; known: {sorted(FUNCTIONS)}")
        arguments = [_evaluate(argument) for argument in node.args]
        try:
            if function in (abs, min, max):
                return function(*arguments)
            value = function(*(float(a) for a in arguments))
        except (ValueError, TypeError, OverflowError) as exc:
            raise CalculatorError(f"{node.func.id}: {exc}") from None
        return Fraction(value) if isinstance(value, int) else _check_size(float(value))
    raise CalculatorError(f"{type(node).__name__} is not allowed in an expression")


def format_number(value: Number) -> str:
    """An exact integer as its digits, anything else as a float with up to 12 significant digits."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def evaluate_expression(expression: str) -> str:
    """The value of an arithmetic expression, as text (:func:`format_number`).

    Raises:
        CalculatorError: a syntax error, a refused construct, division by zero, a too-large result.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    try:
        return format_number(_evaluate(tree))
    except (OverflowError, ZeroDivisionError) as exc:
        raise CalculatorError(str(exc)) from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % **, parentheses and functions such as sqrt, e.g. "4821 * 37 - 1290".
    """
    return evaluate_expression(expression)
