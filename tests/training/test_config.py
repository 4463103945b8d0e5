"""The grouped config dataclasses of the VLM modules (mmpo.training.config): each check fires with its
message, every field is documented, a nested YAML config parses through ``mmpo fit --print_config`` to the
right values, an unknown field is refused, and checkpoints keep the groups as plain dicts."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from mmpo.training.config import (
    GROUPS,
    AdvantageConfig,
    EngineConfig,
    LossConfig,
    OptimConfig,
    RewardConfig,
    RolloutCorrectionConfig,
    SamplingConfig,
    as_config,
    merged_settings,
    plain_hparams,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vlm"


@pytest.mark.parametrize(("cls", "fields", "message"), [
    (SamplingConfig, {"num_generations": 0}, "num_generations must be >= 1, got 0"),
    (SamplingConfig, {"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    (SamplingConfig, {"temperature": 0.0}, "temperature must be > 0, got 0.0"),
    (SamplingConfig, {"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    (SamplingConfig, {"val_max_new_tokens": 0}, "val_max_new_tokens must be >= 1 or None, got 0"),
    (LossConfig, {"beta": -0.1}, "beta must be >= 0, got -0.1"),
    (LossConfig, {"kl_kind": "k4"}, "unknown kl_kind 'k4'; valid:"),
    (LossConfig, {"name": "nope"}, r"unknown loss 'nope'; valid: \['aspo', "),
    (LossConfig, {"agg": "mean"}, "unknown agg 'mean'; valid:"),
    (LossConfig, {"norm_len": 0}, "norm_len must be >= 1 or None, got 0"),
    (LossConfig, {"clip_low": 1.0}, r"clip_low must be in \[0, 1\), got 1.0"),
    (LossConfig, {"clip_high": -0.1}, "clip_high must be >= 0, got -0.1"),
    (LossConfig, {"dual_clip": 1.0}, "dual_clip must be > 1 or None, got 1.0"),
    (LossConfig, {"entropy_coef": -1.0}, "entropy_coef must be >= 0, got -1.0"),
    (AdvantageConfig, {"name": "gae2"}, "unknown advantage 'gae2'; valid:"),
    (AdvantageConfig, {"dynamic_sampling_retries": -1}, "dynamic_sampling_retries must be >= 0, got -1"),
    (AdvantageConfig, {"settings": {"eps": 0.1}}, "advantage settings must not hold eps; set advantage.eps"),
    (OptimConfig, {"lr": 0.0}, "lr must be > 0, got 0.0"),
    (OptimConfig, {"weight_decay": -1.0}, "weight_decay must be >= 0, got -1.0"),
    (OptimConfig, {"betas": (0.9, 1.0)}, r"betas must be two values in \[0, 1\), got \[0.9, 1.0\]"),
    (OptimConfig, {"betas": (0.9,)}, r"betas must be two values in \[0, 1\), got \[0.9\]"),
    (OptimConfig, {"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    (OptimConfig, {"lr_schedule": "step"}, "unknown schedule 'step'; valid:"),
    (OptimConfig, {"max_grad_norm": -1.0}, "max_grad_norm must be >= 0, got -1.0"),
    (OptimConfig, {"mu": 0}, r"mu \(inner epochs\) must be >= 1, got 0"),
    (OptimConfig, {"minibatch_size": 0}, "minibatch_size must be >= 1 or None, got 0"),
    (OptimConfig, {"micro_batch_size": 0}, "micro_batch_size must be >= 1 or None, got 0"),
    (OptimConfig, {"minibatch_size": 6, "micro_batch_size": 4},
     r"micro_batch_size 4 must divide minibatch_size 6; valid: \[1, 2, 3, 6\]"),
    (RolloutCorrectionConfig, {"mode": "token"}, "unknown rollout_is mode 'token'"),
    (RolloutCorrectionConfig, {"mode": "token_mask", "cap": 0.0}, "rollout_is_cap must be > 0, got 0.0"),
    (RolloutCorrectionConfig, {"cap_low": 3.0}, r"rollout_is_cap_low must be in \[0, rollout_is_cap=2.0\)"),
    (EngineConfig, {"name": "sglang"}, "rollout_engine must be hf or vllm, got 'sglang'"),
    (RewardConfig, {"timeout_s": 0.0}, "reward_timeout_s must be > 0, got 0.0"),
])
def test_each_check_fires_with_its_message(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**fields)


def test_defaults_are_the_flat_settings_defaults():
    assert SamplingConfig() == SamplingConfig(num_generations=4, max_new_tokens=64, temperature=1.0, top_p=1.0,
                                              val_max_new_tokens=None)
    assert LossConfig() == LossConfig(name="ppo", clip_low=None, clip_high=None, dual_clip=None, settings=None,
                                      agg="token-mean", norm_len=None, kl_kind="k3", beta=0.01, entropy_coef=0.0)
    assert AdvantageConfig() == AdvantageConfig(name="grpo", eps=1e-6, dynamic_sampling=False,
                                                dynamic_sampling_retries=0, settings=None)
    assert OptimConfig() == OptimConfig(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=0,
                                        lr_schedule="constant", max_grad_norm=1.0, mu=1, minibatch_size=None,
                                        micro_batch_size=None)
    assert RolloutCorrectionConfig() == RolloutCorrectionConfig(mode=None, cap=2.0, cap_low=None, bypass=False)
    assert EngineConfig() == EngineConfig(name="hf", vllm_max_model_len=4096, vllm_max_num_batched_tokens=16384,
                                          vllm_gpu_memory_utilization=0.3)
    assert RewardConfig() == RewardConfig(weights=None, timeout_s=10.0)


@pytest.mark.parametrize("cls", sorted(GROUPS.values(), key=lambda c: c.__name__))
def test_every_field_has_a_one_line_doc_and_the_config_is_frozen(cls):
    doc = inspect.getdoc(cls)
    attributes = doc.split("Attributes:", 1)[1]
    documented = {line.strip().split(":", 1)[0] for line in attributes.splitlines()
                  if line.startswith("    ") and not line.startswith("        ")}
    assert documented == {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cls(), dataclasses.fields(cls)[0].name, None)


def test_betas_from_a_list_are_a_tuple():
    """A YAML or checkpoint list gives the same config as the tuple (what AdamW gets)."""
    assert as_config({"betas": [0.9, 0.99]}, OptimConfig()) == OptimConfig(betas=(0.9, 0.99))
    assert OptimConfig(betas=[0.9, 0.99]).betas == (0.9, 0.99)


def test_as_config_reads_instances_dicts_and_none():
    default = SamplingConfig(num_generations=8)
    assert as_config(None, default) is default
    assert as_config({"temperature": 0.5}, default) == SamplingConfig(num_generations=8, temperature=0.5)
    given = SamplingConfig(num_generations=2)
    assert as_config(given, default) is given
    with pytest.raises(TypeError, match="expected SamplingConfig"):
        as_config(LossConfig(), default)
    with pytest.raises(TypeError, match="bogus"):
        as_config({"bogus": 1}, default)


def test_merged_settings_merge_groups_field_by_field():
    merged = merged_settings({"sampling": SamplingConfig(num_generations=3), "seed": 1},
                             {"sampling": {"temperature": 0.5}, "optim": {"mu": 2}, "seed": 2})
    assert merged["sampling"] == dataclasses.asdict(SamplingConfig(num_generations=3, temperature=0.5))
    assert merged["optim"] == {"mu": 2} and merged["seed"] == 2
    assert plain_hparams({"optim": OptimConfig(), "seed": 0}) == {"optim": dataclasses.asdict(OptimConfig()),
                                                                    "seed": 0}


def _print_config(capsys, *argv: str) -> dict:
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *argv, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]


def test_nested_yaml_parses_to_the_groups_with_module_defaults(tmp_path, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "mmpo.algos.mapo.MAPOModule", "init_args": {
        "model_path": "runs/x",
        "sampling": {"num_generations": 6, "temperature": 0.8},
        "loss": {"name": "gspo", "clip_low": 3e-4, "beta": 0.0},
        "advantage": {"dynamic_sampling": True},
        "optim": {"lr": 2e-6, "minibatch_size": 12},
        "rollout_correction": {"mode": "token_truncate", "cap": 3.0},
        "rewards": {"weights": {"accuracy": 1.0}, "timeout_s": None},
    }}}))
    args = _print_config(capsys, "-c", str(config), "--model.init_args.sampling.max_new_tokens=32")
    assert args["sampling"] == {"num_generations": 6, "max_new_tokens": 32, "temperature": 0.8, "top_p": 1.0,
                                "val_max_new_tokens": None}
    assert (args["loss"]["name"], args["loss"]["clip_low"], args["loss"]["beta"], args["loss"]["kl_kind"]) == (
        "gspo", 3e-4, 0.0, "k3")
    # MAPO's own default advantage name is kept: a config group sets some fields over the module's defaults
    assert args["advantage"] == {"name": "mapo", "eps": 1e-6, "dynamic_sampling": True, "dynamic_sampling_retries": 0,
                                 "settings": None}
    assert (args["optim"]["lr"], args["optim"]["minibatch_size"], args["optim"]["mu"]) == (2e-6, 12, 1)
    assert args["rollout_correction"] == {"mode": "token_truncate", "cap": 3.0, "cap_low": None, "bypass": False}
    assert args["rollout_engine"]["name"] == "hf"
    assert args["rewards"] == {"weights": {"accuracy": 1.0}, "timeout_s": None, "models": None}


def test_the_parsed_config_instantiates_the_dataclasses():
    from jsonargparse import ArgumentParser

    from mmpo.algos.grpo import GRPOModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(GRPOModule, "model", instantiate=False)  # the groups, not the module
    parsed = parser.parse_args(["--model.model_path=x", "--model.sampling.num_generations=2",
                                "--model.loss={name: gpg, beta: 0.0}"])
    model = parser.instantiate(parsed).model
    assert model["sampling"] == SamplingConfig(num_generations=2)
    assert model["loss"] == LossConfig(name="gpg", beta=0.0)
    assert model["optim"] == OptimConfig()


@pytest.mark.parametrize(("argv", "name"), [
    (["--model.init_args.sampling.num_samples=2"], "num_samples"),
    (["--model.init_args.loss={name: ppo, bogus: 1}"], "bogus"),
])
def test_an_unknown_field_is_refused_naming_it(argv, name, capsys):
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:  # refused while parsing: nothing is built or trained
        main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mmpo fit: error: model") and name in last


def test_an_unknown_field_in_a_yaml_group_is_refused(tmp_path, capsys):
    from mmpo.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  init_args:\n    optim: {lr: 1.0e-6, learning_rate: 2.0e-6}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), "-c", str(config)])
    assert exit_info.value.code == 2
    assert "learning_rate" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_flat_setting_of_the_old_shape_is_refused(capsys):
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), "--model.init_args.num_generations=2"])
    assert exit_info.value.code == 2
    assert "num_generations" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_null_field_on_the_command_line_becomes_a_mapping(capsys):
    """jsonargparse reads ``--model.init_args.loss.clip_low=null`` as the string 'None' in subclass mode:
    mmpo passes it as ``{clip_low: null}`` (the group's other values are kept)."""
    from mmpo.training.cli_support import nested_nulls_as_mappings

    assert nested_nulls_as_mappings(["fit", "--model.init_args.loss.clip_low=null", "--model.init_args.loss.beta=0",
                                     "--model.init_args.loss.clip_high", "~", "--trainer.max_steps=null"]) == [
        "fit", "--model.init_args.loss={clip_low: null}", "--model.init_args.loss.beta=0",
        "--model.init_args.loss={clip_high: null}", "--trainer.max_steps=null"]
    args = _print_config(capsys, "-c", str(CONFIGS / "grpo_tiny.yaml"), "--model.init_args.loss.clip_low=null")
    assert (args["loss"]["clip_low"], args["loss"]["clip_high"], args["loss"]["beta"]) == (None, 0.28, 0.0)
