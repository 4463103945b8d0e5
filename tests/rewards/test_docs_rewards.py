"""The runnable example of docs/rewards.md runs and gives the values its comments state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmpo.rewards.models import MODEL_REWARDS

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    text = (ROOT / "docs" / "rewards.md").read_text()
    match = re.search(r"<!-- example: model rewards -->\n```python\n(.*?)\n```", text, re.S)
    assert match, "docs/rewards.md lost its example block"
    return match.group(1)


def test_the_documented_model_rewards_example_runs(capsys):
    MODEL_REWARDS.clear()
    namespace: dict = {"__name__": "docs_rewards_example"}
    try:
        exec(compile(_example(), "docs/rewards.md", "exec"), namespace)
    finally:
        MODEL_REWARDS.clear()
    rm = namespace["per_fn"]["helpful_rm"].tolist()
    assert namespace["per_fn"]["judge"].tolist() == pytest.approx([0.9, 0.2])
    assert namespace["per_fn"]["accuracy"].tolist() == [1.0, 0.0]
    assert namespace["total"].tolist() == pytest.approx([1 + 0.5 * rm[0] + 0.45, 0.5 * rm[1] + 0.1], abs=1e-6)
    assert rm[0] != rm[1]  # the reward model tells the two completions apart (distinct inputs)
    assert capsys.readouterr().out.splitlines()[0] == str(namespace["per_fn"]["judge"].tolist())
