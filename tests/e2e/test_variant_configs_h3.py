"""The #16 variant configs of LSPO, EPO, SFPO and HAPO parse through `mmpo fit --print_config` and keep
their module class and headline settings (each also trains 2 steps in tests/algos/test_variant_<name>.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmpo.cli import main

VARIANTS = Path(__file__).resolve().parents[2] / "configs" / "vlm" / "variants"


@pytest.mark.parametrize(("name", "class_path", "settings"), [
    ("lspo_tiny", "mmpo.algos.lspo.LSPOModule", {"lspo_low": 0.3, "lspo_high": 0.65, "advantage.dynamic_sampling": True}),
    ("epo_tiny", "mmpo.algos.epo.EPOModule", {"loss.entropy_coef": 0.001, "epo_min_ratio": 0.5, "epo_penalty": 0.1}),
    ("sfpo_tiny", "mmpo.algos.sfpo.SFPOModule", {"sfpo_inner_steps": 3, "sfpo_alpha": 0.8}),
    ("hapo_tiny", "mmpo.algos.hapo.HAPOModule", {"loss.name": "hapo", "advantage.name": "hapo", "loss.dual_clip": 10.0}),
])
def test_variant_config_parses(name, class_path, settings, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(VARIANTS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["class_path"] == class_path
    assert model["init_args"]["model_path"] == "runs/tiny/sft"
    for key, value in settings.items():  # "group.field": a field of a config group (mmpo.training.config)
        group, _, field = key.rpartition(".")
        assert (model["init_args"][group][field] if group else model["init_args"][key]) == value, key
