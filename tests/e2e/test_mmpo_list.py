"""``mmpo list``: every name of every registry, read from the registries themselves, with a description."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmpo.cli import main
from mmpo.listing import REGISTRIES, first_sentence

REPO = Path(__file__).resolve().parents[2]


def _listed(text: str) -> dict[str, dict[str, str]]:
    """``{title: {name: description}}`` parsed from ``mmpo list``'s output."""
    tables: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            current = tables.setdefault(line[:-1], {})
        elif line.startswith("  ") and current is not None:
            name, _, description = line.strip().partition("  ")
            current[name] = description.strip()
    return tables


def _config_class_paths() -> set[str]:
    paths = set()
    for config in REPO.glob("configs/**/*.yaml"):
        model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
        if isinstance(model, dict) and "class_path" in model:
            paths.add(model["class_path"])
    return paths


def test_first_sentence():
    assert first_sentence("One line.\n\n    More.") == "One line."
    assert first_sentence("GRPO (a) wrapped\n    onto two lines. Second sentence.\n") == "GRPO (a) wrapped onto two lines."
    assert first_sentence(None) == ""


def test_list_prints_every_registered_name(capsys):
    from mmpo.core import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_KINDS, POLICY_LOSSES
    from mmpo.eval.registry import available_benchmarks
    from mmpo.rewards import REWARDS
    from mmpo.robotics.envs.tasks import TASKS

    assert main(["list"]) == 0
    tables = _listed(capsys.readouterr().out)
    assert list(tables) == [title for title, _, _ in REGISTRIES.values()]
    by_key = {key: tables[title] for key, (title, _, _) in REGISTRIES.items()}
    assert sorted(by_key["advantages"]) == ADVANTAGE_ESTIMATORS.names()
    assert sorted(by_key["losses"]) == POLICY_LOSSES.names()
    assert list(by_key["kl"]) == list(KL_KINDS)
    assert list(by_key["aggregation"]) == list(AGGREGATION_MODES)
    assert sorted(by_key["rewards"]) == sorted(REWARDS) and "step_rar" in REWARDS
    assert list(by_key["benchmarks"]) == available_benchmarks()
    assert sorted(by_key["robot-tasks"]) == sorted(TASKS)
    # every module class a shipped config trains is listed, and each listed one is a trainable class
    assert _config_class_paths() <= set(by_key["algorithms"])
    assert "mmpo.algos.vlm_base.VLMPolicyModule" not in by_key["algorithms"]
    assert by_key["advantages"]["grpo"] == first_sentence(ADVANTAGE_ESTIMATORS.get("grpo").__doc__)
    assert by_key["algorithms"]["mmpo.algos.grpo.GRPOModule"].startswith("Group Relative Policy Optimization")
    for key, table in by_key.items():
        if key != "benchmarks":  # ``file:<path>``'s form has a fixed text; registered ones carry their own
            assert all(table.values()), (key, [n for n, d in table.items() if not d])


def test_list_one_registry(capsys):
    from mmpo.core import ADVANTAGE_ESTIMATORS

    assert main(["list", "advantages"]) == 0
    tables = _listed(capsys.readouterr().out)
    assert list(tables) == [REGISTRIES["advantages"][0]]
    assert sorted(tables[REGISTRIES["advantages"][0]]) == ADVANTAGE_ESTIMATORS.names()


def test_list_without_the_robotics_extra_names_it_and_never_imports_robotics():
    code = ("import sys; sys.modules['robosuite'] = None\n"
            "from mmpo.listing import main\n"
            "main([])\n"
            "assert not any(m.startswith('mmpo.robotics') for m in sys.modules), 'imported robotics'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    tables = _listed(result.stdout)
    assert REGISTRIES["robot-tasks"][0] not in tables
    assert not [n for n in tables[REGISTRIES["algorithms"][0]] if n.startswith("mmpo.robotics")]
    assert "mmpo.dllm.rl.DiffuGRPO" in tables[REGISTRIES["algorithms"][0]]
    assert result.stdout.strip().splitlines()[-1].startswith(
        "mmpo.robotics needs the 'robotics' extra: pip install \"mmpo[robotics]\" (missing: robosuite)")


def test_list_rejects_an_unknown_registry(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["list", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
