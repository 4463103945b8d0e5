"""The "How to add a loss" example of docs/core.md runs as written and stays under 20 lines of code."""

import re
from pathlib import Path

from mmpo.core import POLICY_LOSSES

DOC = Path(__file__).resolve().parents[2] / "docs" / "core.md"


def _example() -> str:
    section = DOC.read_text().split("## How to add a loss", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_the_documented_loss_example_runs():
    code = _example()
    lines = [line for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(lines) < 20, len(lines)
    try:
        exec(compile(code, str(DOC), "exec"), {})  # the example asserts its own hand-computed value
        assert "sqrt_ppo" in POLICY_LOSSES
    finally:
        if "sqrt_ppo" in POLICY_LOSSES:
            POLICY_LOSSES.unregister("sqrt_ppo")
