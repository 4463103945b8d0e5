"""The preference configs (DPO, INPO, DR-PO; tiny and real scale) parse with their module and data classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmpo.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vlm"


@pytest.mark.parametrize(("name", "class_path", "data_class"), [
    ("dpo_tiny", "mmpo.algos.dpo.DPOModule", "PreferenceDataModule"),
    ("dpo_qwen2_5_vl_7b", "mmpo.algos.dpo.DPOModule", "PreferenceDataModule"),
    ("inpo_tiny", "mmpo.algos.inpo.INPOModule", "PromptDataModule"),
    ("inpo_qwen2_5_vl_7b", "mmpo.algos.inpo.INPOModule", "PromptDataModule"),
    ("drpo_tiny", "mmpo.algos.drpo.DRPOModule", "PreferenceDataModule"),
    ("drpo_qwen2_5_vl_7b", "mmpo.algos.drpo.DRPOModule", "PreferenceDataModule"),
])
def test_preference_configs_parse(name, class_path, data_class, capsys):
    """Real-scale configs are not run here, but every key must be a valid init argument."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"] == class_path
    assert config["data"]["class_path"] == f"mmpo.data.datamodule.{data_class}"
