"""Every shipped config parses through `mmpo fit --print_config` to a known class, and the class path it names
is under ``mmpo`` (the 2-step runs of the tiny configs are in the family tests: tests/algos, tests/dllm,
tests/robotics, tests/e2e; the real-scale VLM and text-LM configs train 2 steps shrunk to tiny models in
tests/e2e/test_real_scale_configs_shrunk.py (dLLM: tests/dllm/test_real_scale_config_shrunk.py) and are sized by `mmpo estimate` in tests/vlm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmpo.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# configs/practice holds `mmpo practice` configs (prompt-space optimisation, not a Lightning fit)
ALL = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml") if p.parent.name != "practice")
PRACTICE = sorted(p.relative_to(CONFIGS).as_posix() for p in (CONFIGS / "practice").glob("*.yaml"))


def test_the_configs_are_found():
    assert len(ALL) >= 40 and "vlm/grpo_tiny.yaml" in ALL and "robotics/dppo_lift.yaml" in ALL
    # the text-LM configs (issue 38)
    assert {f"llm/{name}.yaml" for name in ("sft_tiny", "grpo_tiny", "dpo_tiny", "grpo_qwen2_5_7b_instruct",
                                            "grpo_qwen3_8b")} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_config_parses(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / name), "--print_config"])
    assert exit_info.value.code == 0, capsys.readouterr().err[-2000:]
    printed = yaml.safe_load(capsys.readouterr().out)
    declared = yaml.safe_load((CONFIGS / name).read_text())["model"]["class_path"]
    assert printed["model"]["class_path"] == declared and declared.startswith("mmpo.")


@pytest.mark.parametrize("name", PRACTICE)
def test_practice_config_parses(name):
    from mmpo.practice.cli import build_parser
    from mmpo.practice.loop import PracticeConfig

    args = build_parser().parse_args(["-c", str(CONFIGS / name)])
    PracticeConfig(**{key: args[key] for key in PracticeConfig.__dataclass_fields__}).check()
    assert "practice/training_free_grpo_tiny.yaml" in PRACTICE
