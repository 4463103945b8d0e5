"""The dLLM modules' config groups (mmpo.dllm.config): each check fires with its message, every field is
documented, the module defaults are the flat settings' of before, YAML and command-line groups parse over
them, and checkpoints saved with the old flat settings load through the mapping."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import yaml

from mmpo.dllm.config import (
    DIFFU_GRPO_ADVANTAGE,
    DIFFU_GRPO_INPAINTING,
    DIFFU_GRPO_LOGPROB,
    DIFFU_GRPO_LOSS,
    DIFFU_GRPO_OPTIM,
    DIFFU_GRPO_REWARDS,
    SFT_OPTIM,
    DiffusionLogProbConfig,
    InpaintingConfig,
    grouped_hparams,
    is_flat_hparams,
)
from mmpo.dllm.hints import HintConfig
from mmpo.dllm.modeling import save_mask_predictor
from mmpo.dllm.sampler import SamplerConfig
from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, RewardConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "dllm"


@pytest.mark.parametrize(("cls", "fields", "message"), [
    (DiffusionLogProbConfig, {"masking": "partial"}, "masking must be 'full' or 'structured', got 'partial'"),
    (DiffusionLogProbConfig, {"p_mask_prompt": 1.5}, r"p_mask_prompt must be in \[0, 1\], got 1.5"),
    (DiffusionLogProbConfig, {"masking": "structured", "diffusion_steps": 8, "min_timestep": 7},
     "need 1 <= min_timestep <= diffusion_steps - 2, got 7 and 8"),
    (DiffusionLogProbConfig, {"chunk_size": 0}, "chunk_size must be >= 1, got 0"),
    (InpaintingConfig, {"max_replacements": -1}, "max_replacements must be >= 0, got -1"),
    (InpaintingConfig, {"entropy_keep": 1.5}, r"entropy_keep must be in \(0, 1\], got 1.5"),
])
def test_each_check_fires_with_its_message(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**fields)


def test_the_schedule_is_only_checked_under_structured_masking():
    assert DiffusionLogProbConfig(diffusion_steps=8, min_timestep=7).masking == "full"


@pytest.mark.parametrize("cls", [DiffusionLogProbConfig, InpaintingConfig])
def test_every_field_has_a_one_line_doc_and_the_config_is_frozen(cls):
    attributes = inspect.getdoc(cls).split("Attributes:", 1)[1]
    documented = {line.strip().split(":", 1)[0] for line in attributes.splitlines()
                  if line.startswith("    ") and not line.startswith("        ")}
    assert documented == {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cls(), dataclasses.fields(cls)[0].name, None)


def test_module_defaults_are_the_flat_settings_of_before():
    from mmpo.dllm.rl import DiffuGRPO
    from mmpo.dllm.sft import MaskedDiffusionSFT

    assert DIFFU_GRPO_OPTIM == OptimConfig(lr=5e-7, weight_decay=0.1, betas=(0.9, 0.99), warmup_steps=50,
                                           lr_schedule="constant", max_grad_norm=0.2, mu=4)
    assert DIFFU_GRPO_LOSS == LossConfig(name="igpo_sequence", clip_low=0.2, clip_high=0.2, settings=None,
                                         agg="token-mean", kl_kind="k3", beta=0.01)
    assert DIFFU_GRPO_ADVANTAGE == AdvantageConfig(name="drgrpo", eps=None, settings=None)
    assert DIFFU_GRPO_REWARDS == RewardConfig(weights={"correct": 1.0}, timeout_s=10.0)
    assert DIFFU_GRPO_LOGPROB == DiffusionLogProbConfig(masking="full", p_mask_prompt=0.0, diffusion_steps=128,
                                                        min_timestep=30, chunk_size=1024)
    assert DIFFU_GRPO_INPAINTING == InpaintingConfig(enabled=True, max_replacements=4, entropy_keep=0.2)
    assert SFT_OPTIM == OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=50, max_grad_norm=0.0)
    grpo = inspect.signature(DiffuGRPO).parameters
    assert {name: grpo[name].default for name in ("loss", "advantage", "optim", "rewards", "logprob", "igpo")} == {
        "loss": DIFFU_GRPO_LOSS, "advantage": DIFFU_GRPO_ADVANTAGE, "optim": DIFFU_GRPO_OPTIM,
        "rewards": DIFFU_GRPO_REWARDS, "logprob": DIFFU_GRPO_LOGPROB, "igpo": DIFFU_GRPO_INPAINTING}
    assert inspect.signature(MaskedDiffusionSFT).parameters["optim"].default == SFT_OPTIM


# ---------------------------------------------------------------------- YAML and command line


def _print_config(capsys, *argv: str) -> dict:
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *argv, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]


def test_the_8b_yaml_parses_to_its_values_over_the_module_defaults(capsys):
    written = yaml.safe_load((CONFIGS / "igpo_llada_8b.yaml").read_text())["model"]["init_args"]
    args = _print_config(capsys, "-c", str(CONFIGS / "igpo_llada_8b.yaml"))
    for group in ("optim", "loss", "logprob", "rewards", "igpo"):
        assert {key: args[group][key] for key in written[group]} == written[group], group
    assert args["optim"]["lr"] == 5e-7 and args["optim"]["lr_schedule"] == "linear"
    assert args["rewards"]["weights"] == {"correct": 3.0, "xmlcount": 1.0}
    assert args["advantage"]["name"] == "drgrpo"  # not in the YAML: the module's default


def test_a_command_line_field_sets_one_field_of_a_group(capsys):
    args = _print_config(capsys, "-c", str(CONFIGS / "igpo_tiny.yaml"), "--model.init_args.optim.lr=1e-6",
                         "--model.init_args.logprob.masking=structured")
    assert args["optim"] == {**dataclasses.asdict(DIFFU_GRPO_OPTIM), "lr": 1e-6, "mu": 2, "warmup_steps": 5,
                             "betas": [0.9, 0.99]}
    assert args["logprob"]["masking"] == "structured" and args["logprob"]["p_mask_prompt"] == 0.0


def test_the_sft_yaml_parses_to_its_optim(capsys):
    args = _print_config(capsys, "-c", str(CONFIGS / "sft_tiny.yaml"), "--model.init_args.optim.weight_decay=0.0")
    assert (args["optim"]["lr"], args["optim"]["warmup_steps"], args["optim"]["weight_decay"]) == (1e-3, 50, 0.0)


@pytest.mark.parametrize(("argv", "name"), [
    (["--model.init_args.lr=1e-6"], "lr"),  # an old flat name
    (["--model.init_args.optim.learning_rate=1e-6"], "learning_rate"),
    (["--model.init_args.logprob={masking: full, chunk: 4}"], "chunk"),
])
def test_an_unknown_or_flat_field_is_refused_naming_it(argv, name, capsys):
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "igpo_tiny.yaml"), *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mmpo fit: error: model") and name in last


def test_a_bad_field_value_is_one_line_naming_the_field(capsys):
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "igpo_tiny.yaml"), "--model.init_args.igpo.entropy_keep=0"])
    assert exit_info.value.code == 2
    assert "entropy_keep must be in (0, 1], got 0" in capsys.readouterr().err.strip().splitlines()[-1]


# ---------------------------------------------------------------------- checkpoints of the flat settings

FLAT = dict(
    model_path="m", warmup_config=None, save_dir="s", group_size=3, inner_updates=2, lr=1e-2, weight_decay=0.0,
    betas=(0.9, 0.95), warmup_steps=0, lr_schedule="linear", max_grad_norm=1e9, beta=0.05, kl_kind="k2",
    clip_low=0.2, clip_high=0.28, ratio_level="token", loss=None, loss_settings=None, advantage="grpo",
    advantage_settings={"eps": 1e-4}, loss_agg="seq-mean-token-mean", p_mask_prompt=0.15, masking="structured",
    diffusion_steps=16, min_timestep=3, correct_reward=3.0, format_reward="derivation", reward_timeout_s=None,
    igpo=False, max_replacements=1, entropy_keep=0.5, logprob_chunk_size=64, seed=7,
    sampler={"gen_length": 8, "block_length": 8, "steps": 4, "temperature": 1.2, "remasking": "low_confidence"},
)


def test_grouped_hparams_maps_every_flat_name():
    grouped = grouped_hparams(FLAT)
    assert grouped["optim"] == {"mu": 2, "lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.95], "warmup_steps": 0,
                                "lr_schedule": "linear", "max_grad_norm": 1e9}
    assert grouped["loss"] == {"name": "ppo", "beta": 0.05, "kl_kind": "k2", "clip_low": 0.2, "clip_high": 0.28,
                               "settings": None, "agg": "seq-mean-token-mean"}
    assert grouped["advantage"] == {"name": "grpo", "eps": 1e-4, "settings": None}
    assert grouped["logprob"] == {"p_mask_prompt": 0.15, "masking": "structured", "diffusion_steps": 16,
                                  "min_timestep": 3, "chunk_size": 64}
    assert grouped["rewards"] == {"weights": {"correct": 3.0, "derivation": 1.0}, "timeout_s": None}
    assert grouped["igpo"] == {"enabled": False, "max_replacements": 1, "entropy_keep": 0.5}
    kept = {"model_path", "warmup_config", "save_dir", "group_size", "seed", "sampler"}
    assert {key: grouped[key] for key in kept} == {key: FLAT[key] for key in kept}
    assert set(grouped) == kept | {"optim", "loss", "advantage", "logprob", "rewards", "igpo"}
    # a loss name with the default ratio level, and the variants' flat names
    assert grouped_hparams({"ratio_level": "sequence", "loss": "sapo"})["loss"] == {"name": "sapo"}
    assert grouped_hparams({"entropy_coef": 0.5})["loss"] == {"entropy_coef": 0.5}
    assert is_flat_hparams(FLAT) and is_flat_hparams({"advantage": "hapo"})
    assert not is_flat_hparams(grouped) and not is_flat_hparams({"loss": None, "seed": 0})


def _flat_checkpoint(module, trainer_root: Path, flat: dict) -> Path:
    """A checkpoint of ``module`` whose hyperparameters are ``flat`` (as modules of before the groups saved them)."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=trainer_root,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.strategy._lightning_module = module
    path = trainer_root / "flat.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"] = flat
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("variant", ["DiffuGRPO", "EPODiffuGRPO"])
def test_a_flat_checkpoint_loads_with_its_settings(tiny_model_and_tokenizer, tmp_path, variant):
    import mmpo.dllm.rl as rl
    import mmpo.dllm.variants as variants

    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    cls = getattr(variants, variant, None) or getattr(rl, variant)
    flat = {**FLAT, "model_path": str(tmp_path / "start"), "save_dir": str(tmp_path / "out"),
            "hints": dataclasses.asdict(HintConfig(min_chunk=1, max_chunk=2, free_tail=1))}
    if variant == "EPODiffuGRPO":
        flat["entropy_coef"] = 0.25
    module = cls(**grouped_hparams(flat))
    path = _flat_checkpoint(module, tmp_path, flat)
    loaded = cls.load_from_checkpoint(path)
    assert loaded.optim == OptimConfig(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), warmup_steps=0,
                                       lr_schedule="linear", max_grad_norm=1e9, mu=2)
    assert (loaded.loss.name, loaded.loss.beta, loaded.loss.clip_high, loaded.loss.agg) == (
        "ppo", 0.05, 0.28, "seq-mean-token-mean")
    assert loaded.advantage == AdvantageConfig(name="grpo", eps=1e-4)
    assert loaded.rewards.weights == {"correct": 3.0, "derivation": 1.0} and loaded.rewards.timeout_s is None
    assert loaded.logprob == DiffusionLogProbConfig(masking="structured", p_mask_prompt=0.15, diffusion_steps=16,
                                                    min_timestep=3, chunk_size=64)
    assert loaded.igpo == InpaintingConfig(enabled=False, max_replacements=1, entropy_keep=0.5)
    assert loaded.sampler == SamplerConfig(gen_length=8, block_length=8, steps=4) and loaded.seed == 7
    if variant == "EPODiffuGRPO":
        assert loaded.loss.entropy_coef == 0.25
    for name, weight in module.model.state_dict().items():
        assert torch.equal(weight, loaded.model.state_dict()[name]), name
    # a grouped checkpoint (what modules save now) loads as Lightning loads it
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    again = cls.load_from_checkpoint(_flat_checkpoint(module, grouped, dict(module.hparams)))
    assert again.optim == loaded.optim and again.loss == loaded.loss


def test_a_flat_sft_checkpoint_loads_with_its_optim(tiny_model_and_tokenizer, tmp_path):
    from mmpo.dllm.sft import MaskedDiffusionSFT

    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    flat = dict(save_dir=str(tmp_path / "out"), init_from=str(tmp_path / "start"), lr=2e-3, weight_decay=0.0,
                warmup_steps=7, seed=1)
    module = MaskedDiffusionSFT(**grouped_hparams(flat))
    loaded = MaskedDiffusionSFT.load_from_checkpoint(_flat_checkpoint(module, tmp_path, flat))
    assert loaded.optim == OptimConfig(lr=2e-3, weight_decay=0.0, warmup_steps=7, max_grad_norm=0.0)


@pytest.mark.parametrize(("optim", "message"), [
    ({"mu": 2}, r"optim.mu must be 1 for SFT \(one optimizer step per batch\), got 2"),
    ({"max_grad_norm": 1.0}, "optim.max_grad_norm must be 0 for SFT, got 1.0; clip with trainer.gradient_clip_val"),
    ({"micro_batch_size": 2}, "optim.micro_batch_size must be null for SFT"),
])
def test_sft_refuses_the_update_loop_fields_it_would_ignore(tiny_model_and_tokenizer, tmp_path, optim, message):
    from mmpo.dllm.sft import MaskedDiffusionSFT

    with pytest.raises(ValueError, match=message):
        MaskedDiffusionSFT(save_dir=str(tmp_path / "out"), optim=optim)
