"""Tool calls in model text -> tool messages and counts; loading tools and their schemas."""

from pathlib import Path

import pytest

from mmpo.tools.env import ToolEnvironment, ToolStats
from mmpo.tools.functions import ToolSpecError, load_tools
from mmpo.tools.parsing import HermesToolCallParser, MalformedCall, ToolCall
from mmpo.tools.sandbox import SandboxLimits, ToolSandbox

TOOLS = str(Path(__file__).with_name("misbehaving_tools.py"))


def call(name, **arguments):
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_parser_reads_hermes_blocks_and_reports_malformed_ones():
    parser = HermesToolCallParser()
    assert parser.parse("The answer is 4.") == []
    text = call("calculator", expression="1+2") + "\n" + '<tool_call>{"name": "calculator", "arguments": {"expression": 1+}}</tool_call>'
    good, bad = parser.parse(text)
    assert good == ToolCall("calculator", {"expression": "1+2"})
    assert isinstance(bad, MalformedCall) and "not valid JSON" in bad.error
    assert parser.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [ToolCall("f", {"x": 1})]
    unclosed, = parser.parse('<tool_call>{"name": "f"')
    assert isinstance(unclosed, MalformedCall) and "without </tool_call>" in unclosed.error
    not_object, = parser.parse('<tool_call>["f"]</tool_call>')
    assert isinstance(not_object, MalformedCall)


def test_load_tools_builds_schemas_and_refuses_bad_specs():
    calculator, adder = load_tools(["calculator", f"{TOOLS}:add"])
    assert calculator.name == "calculator" and calculator.schema["function"]["parameters"]["required"] == ["expression"]
    assert adder.schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    with pytest.raises(ToolSpecError, match="unknown tool 'calculatr'"):
        load_tools(["calculatr"])
    with pytest.raises(ToolSpecError, match="not found"):
        load_tools(["no/such/file.py:fn"])
    with pytest.raises(ToolSpecError, match="has no 'nope'"):
        load_tools([f"{TOOLS}:nope"])
    with pytest.raises(ToolSpecError, match="JSON schema"):
        load_tools([f"{TOOLS}:untyped"])
    with pytest.raises(ToolSpecError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "mmpo.tools.calculator:calculator"])


@pytest.fixture(scope="module")
def env_parts():
    sandbox = ToolSandbox(SandboxLimits(timeout_s=1.5))
    tools = load_tools(["calculator", f"{TOOLS}:hang", f"{TOOLS}:explode", f"{TOOLS}:huge_result"])
    yield sandbox, tools
    sandbox.shutdown()


def test_tool_environment_turns_every_failure_into_a_message_and_a_count(env_parts):
    sandbox, tools = env_parts
    stats = ToolStats()
    envs = [ToolEnvironment(tools, sandbox, stats=stats) for _ in range(3)]
    assert envs[0].reset({"problem": "What is 2+2?"}) == "What is 2+2?"
    messages = [
        call("calculator", expression="12 * 12") + call("calculator", expr="1") + call("search", query="x"),
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>' + call("hang", seconds=60.0),
        call("explode", message="bad") + call("huge_result") + call("calculator", expression=7),
    ]
    first, second, third = ToolEnvironment.step_batch(envs, messages)
    assert [m["content"] for m in first.observation][0] == "144"
    assert first.observation[1]["content"].startswith("Error: wrong arguments for calculator")
    assert first.observation[2]["content"].startswith("Error: unknown tool 'search'")
    assert second.observation[0]["content"].startswith("Error: the tool call is not valid JSON")
    assert second.observation[1]["content"] == "Error: did not finish within 1.5 s"
    assert third.observation[0]["content"] == "Error: RuntimeError: bad"
    assert third.observation[1]["content"].startswith("Error: output too large")
    assert third.observation[2]["content"] == "Error: argument 'expression' of calculator must be string, got int"
    assert all(m["role"] == "tool" for r in (first, second, third) for m in r.observation)
    assert not any(r.done for r in (first, second, third))
    assert stats.metrics() == {
        "tools/calculator/calls": 3.0, "tools/calculator/errors": 2.0, "tools/calculator/timeouts": 0.0,
        "tools/explode/calls": 1.0, "tools/explode/errors": 1.0, "tools/explode/timeouts": 0.0,
        "tools/hang/calls": 1.0, "tools/hang/errors": 1.0, "tools/hang/timeouts": 1.0,
        "tools/huge_result/calls": 1.0, "tools/huge_result/errors": 1.0, "tools/huge_result/timeouts": 0.0,
        "tools/invalid/calls": 2.0, "tools/invalid/errors": 2.0, "tools/invalid/timeouts": 0.0,
    }
    done = envs[0].step("<think>144</think><answer>144</answer>")
    assert done.done and done.observation == []
