import pytest

from mmpo.tools.calculator import CalculatorError, calculator


@pytest.mark.parametrize("expression, value", [
    ("4821 * 37 - 1290", "177087"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("2 ** 10", "1024"), ("-(3 + 4) * 2", "-14"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("sqrt(16)", "4"), ("1 / 3", "0.333333333333"), ("max(3, 9, 4)", "9"),
    ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"), ("(123456789 * 987654321)", "121932631112635269"),
])
def test_hand_expressions(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, fragment", [
    ("__import__('os').system('true')", "not allowed"), ("open('x')", "unknown function"), ("1 / 0", "division by zero"),
    ("2 ** 10 ** 10", "exponent"), ("9 ** 999 * 9 ** 999", "digits"), ("x + 1", "unknown name"), ("1 +", "syntax error"),
    ("'a' * 3", "not allowed"), ("(1).real", "not allowed"), ("sqrt(-1)", "sqrt"),
])
def test_refused_expressions(expression, fragment):
    with pytest.raises(CalculatorError, match=fragment):
        calculator(expression)
