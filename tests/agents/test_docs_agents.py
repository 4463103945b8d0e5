"""The user tool of docs/agents.md (examples/tools.py) loads with its schema and runs through the sandbox and
the tool environment."""

import json
from pathlib import Path

from mmpo.tools.env import ToolEnvironment, ToolStats
from mmpo.tools.functions import load_tools
from mmpo.tools.sandbox import SandboxLimits, ToolSandbox

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_user_tool_runs(monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs name it relative to the repository root
    assert "def unit_price(total_cents: int, count: int) -> str:" in (ROOT / "docs" / "agents.md").read_text()
    tool, = load_tools(["examples/tools.py:unit_price"])
    parameters = tool.schema["function"]["parameters"]
    assert tool.name == "unit_price" and parameters["required"] == ["total_cents", "count"]
    assert parameters["properties"]["count"] == {"type": "integer", "description": "how many items there are."}
    sandbox = ToolSandbox(SandboxLimits(timeout_s=5.0))
    stats = ToolStats()
    try:
        env = ToolEnvironment([tool], sandbox, stats=stats)
        call = lambda **arguments: "<tool_call>" + json.dumps({"name": "unit_price", "arguments": arguments}) + "</tool_call>"
        result = env.step(call(total_cents=1000, count=3) + call(total_cents=5, count=0))
    finally:
        sandbox.shutdown()
    assert [m["content"] for m in result.observation] == ["333", "Error: ValueError: count must be positive"]
    assert stats.metrics()["tools/unit_price/calls"] == 2.0 and stats.metrics()["tools/unit_price/errors"] == 1.0
