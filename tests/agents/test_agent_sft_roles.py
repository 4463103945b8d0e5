"""AgentSFTModule: a row's own ``tool_schemas`` replace the module's tools in its prompt (one SFT run teaches
MATPO's planner, its workers and a single agent, each with the prompt its rollout shows)."""

from __future__ import annotations

from mmpo.algos.agent import AgentSFTModule
from mmpo.algos.matpo import SUBAGENT_SCHEMA
from mmpo.tools.functions import load_tools, tool_system_prompt


def test_rows_may_carry_their_own_tool_schemas():
    module = AgentSFTModule.__new__(AgentSFTModule)  # the prompt hook alone, without a model
    module.tools = load_tools(["mmpo.tools.lookup:lookup"], "tools")
    module.system_prompt = "SYS"
    lookup = module.tools[0].schema
    rows = [{"tool_trace": []}, {"tool_trace": [], "tool_schemas": [SUBAGENT_SCHEMA]},
            {"tool_trace": [], "tool_schemas": [], "system_prompt": "WORKER"}]
    out = module._prompt_rows(rows)
    assert out[0]["system_prompt"] == tool_system_prompt("SYS", [lookup])
    assert out[1]["system_prompt"] == tool_system_prompt("SYS", [SUBAGENT_SCHEMA])
    assert '"subagent"' in out[1]["system_prompt"] and '"lookup"' not in out[1]["system_prompt"]
    assert out[2]["system_prompt"] == "WORKER"  # no tools: the system prompt unchanged


def test_val_max_turns_below_one_fails_before_the_model_loads():
    import pytest

    with pytest.raises(ValueError, match=r"^val_max_turns must be >= 1, got 0$"):
        AgentSFTModule("does/not/exist", tools=["codebook"], val_max_turns=0)
