"""The issue-16 structured-rollout estimators need inputs only their VLM modules build (budgeted
summaries, tree paths, Monte Carlo values, a critic): the dLLM path refuses them up front, naming
what is missing, instead of failing mid-step."""

from __future__ import annotations

import pytest

from mmpo.dllm.rl import check_advantage_choice


@pytest.mark.parametrize(("name", "missing"), [
    ("brpo", "budget_scores"), ("treepo", "path_ids"), ("segment", "state_values"), ("tppo", "bootstrap_values"),
])
def test_dllm_refuses_structured_estimators(name, missing):
    with pytest.raises(ValueError, match=f"needs the input.*{missing}.*does not compute"):
        check_advantage_choice(name, None, group_size=4)
