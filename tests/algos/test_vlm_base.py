"""VLMPolicyModule: the settings every VLM module shares are declared once, and LightningCLI
(jsonargparse, following ``**kwargs`` into ``super().__init__``) still lists each of them, typed,
for every module, with each module's own defaults."""

from __future__ import annotations

import dataclasses

import pytest
from jsonargparse import ArgumentParser

from mmpo.algos.ahpo import AHPOModule
from mmpo.algos.grpo import GRPOModule
from mmpo.algos.papo import PAPOModule
from mmpo.algos.sft import SFTModule
from mmpo.training.config import OptimConfig

SHARED = {"max_prompt_length": None,
          "min_pixels": None, "max_pixels": None, "dtype": "float32", "gradient_checkpointing": False,
          "system_prompt": "default", "output_dir": None, "overwrite_output": False, "max_consecutive_skips": 10}


@pytest.mark.parametrize("cls,lr,save_hf", [(GRPOModule, 1e-6, False), (SFTModule, 1e-4, True),
                                            (PAPOModule, 1e-6, False), (AHPOModule, 1e-6, False)])
def test_every_shared_setting_is_a_typed_cli_argument(cls, lr, save_hf):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "model")
    defaults = parser.get_defaults().model
    for name, value in {**SHARED, "save_hf_on_checkpoint": save_hf}.items():
        assert defaults[name] == value, name
    # the optimizer settings are a typed group (mmpo.training.config.OptimConfig) with the module's defaults
    assert dict(vars(defaults.optim)) == dataclasses.asdict(OptimConfig(lr=lr))
    config = parser.parse_args(["--model.model_path=x", "--model.optim.warmup_steps=7", "--model.dtype=bfloat16"]).model
    assert (config.optim.warmup_steps, config.optim.lr, config.dtype) == (7, lr, "bfloat16")
    with pytest.raises(Exception, match="warmup_steps"):  # typed: an int, not any string
        parser.parse_args(["--model.model_path=x", "--model.optim.warmup_steps=many"])
