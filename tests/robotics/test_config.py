"""The grouped settings of the robot RL modules (mmpo.robotics.config, CriticConfig of mmpo.training.config):
each check fires with its message, every field is documented, the shipped configs parse to the groups (with
the module's defaults for the fields they leave out and command-line overrides), an unknown or old flat field
is refused, and an old checkpoint's flat hyperparameters land in the right group fields."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from mmpo.robotics.config import (
    DPPO_FLAT_NAMES,
    GAUSSIAN_FLAT_NAMES,
    DenoisingChainConfig,
    EnvConfig,
    EvalConfig,
    GaussianPolicyConfig,
    PPOLossConfig,
    ReturnsConfig,
    grouped_hparams,
    has_flat_hparams,
    merged_settings,
)
from mmpo.robotics.dppo import DPPO_OPTIM, DPPOModule, check_update_settings
from mmpo.robotics.gaussian_ppo import GaussianPPOModule
from mmpo.training.config import CriticConfig, OptimConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "robotics"
ROBOT_GROUPS = (EnvConfig, DenoisingChainConfig, ReturnsConfig, PPOLossConfig, EvalConfig, GaussianPolicyConfig,
                CriticConfig)


@pytest.mark.parametrize(("cls", "fields", "message"), [
    (EnvConfig, {"num_envs": 0}, "num_envs must be >= 1, got 0"),
    (EnvConfig, {"n_steps": 0}, "n_steps must be >= 1, got 0"),
    (EnvConfig, {"num_envs": 2, "env_groups": 3}, r"env_groups must be in \[1, num_envs=2\], got 3"),
    (EnvConfig, {"act_steps": 0}, "act_steps must be >= 1 or None, got 0"),
    (EnvConfig, {"max_episode_steps": 0}, "max_episode_steps must be >= 1 or None, got 0"),
    (EnvConfig, {"max_worker_restarts": -1}, "max_worker_restarts must be >= 0, got -1"),
    (DenoisingChainConfig, {"ft_steps": 0}, "ft_steps must be >= 1, got 0"),
    (DenoisingChainConfig, {"gamma_denoise": 1.5}, r"gamma_denoise must be in \[0, 1\], got 1.5"),
    (DenoisingChainConfig, {"clip_base": 0.0}, "clip_base and clip_final must be > 0, got 0.0, 0.01"),
    (DenoisingChainConfig, {"noise_clip": 0.0}, "noise_clip must be > 0, got 0.0"),
    (DenoisingChainConfig, {"logprob_min": 2.0}, "logprob_min must be < logprob_max, got 2.0, 2.0"),
    (DenoisingChainConfig, {"rollout_ddim_steps": 0}, "rollout_ddim_steps must be >= 1 or None, got 0"),
    (ReturnsConfig, {"gamma": 1.5}, r"gamma must be in \[0, 1\], got 1.5"),
    (ReturnsConfig, {"lam": -0.1}, r"lam must be in \[0, 1\], got -0.1"),
    (ReturnsConfig, {"reward_scale_gamma": 1.5}, r"reward_scale_gamma must be in \[0, 1\], got 1.5"),
    (PPOLossConfig, {"target_kl": 0.0}, "target_kl must be > 0 or None, got 0.0"),
    (EvalConfig, {"every": -1}, r"every must be >= 0 \(0 = never\), got -1"),
    (EvalConfig, {"episodes": 0}, "episodes must be >= 1, got 0"),
    (EvalConfig, {"sampler": "euler"}, r"unknown sampler 'euler'; valid: \[None, 'ddpm', 'ddim'\]"),
    (EvalConfig, {"ddpm_std_floor": -1.0}, "eval_ddpm_std_floor must be >= 0 or None, got -1.0"),
    (GaussianPolicyConfig, {"clip_coef": 0.0}, "clip_coef must be > 0, got 0.0"),
    (GaussianPolicyConfig, {"ent_coef": -1.0}, "ent_coef must be >= 0, got -1.0"),
    (GaussianPolicyConfig, {"log_prob_reduction": "avg"}, r"log_prob_reduction must be one of \('sum', 'mean'\)"),
    (CriticConfig, {"lr": 0.0}, "lr must be > 0, got 0.0"),
    (CriticConfig, {"vf_coef": -0.5}, "vf_coef must be >= 0, got -0.5"),
    (CriticConfig, {"warmup_iterations": -1}, "warmup_iterations must be >= 0, got -1"),
    (CriticConfig, {"hidden_dims": []}, r"hidden_dims must be a non-empty list of widths >= 1 or None, got \[\]"),
])
def test_each_check_fires_with_its_one_line_message(cls, fields, message):
    with pytest.raises(ValueError, match=message) as error:
        cls(**fields)
    assert "\n" not in str(error.value)


def test_defaults_are_the_flat_settings_defaults():
    """DPPOModule's defaults before the groups: num_envs 50, n_steps 300, K' 10, clip 0.001 -> 0.01, actor lr 1e-4,
    critic lr 1e-3, batch 7500, 10 epochs, vf_coef 0.5, target_kl 1.0, no clipping, 2 warm-up iterations."""
    defaults = {name: p.default for name, p in inspect.signature(DPPOModule.__init__).parameters.items()}
    assert defaults["env"] == EnvConfig(num_envs=50, n_steps=300, reset_at_iteration=True, asynchronous=True,
                                        env_groups=1, prefetch_reset=False, skip_final_autoreset=True,
                                        max_worker_restarts=3)
    assert defaults["chain"] == DenoisingChainConfig(ft_steps=10, gamma_denoise=0.99, clip_base=0.001, clip_final=0.01,
                                                     clip_rate=3.0, min_sampling_std=0.1, noise_clip=3.0,
                                                     min_logprob_std=0.1, logprob_min=-5.0, logprob_max=2.0)
    assert defaults["returns"] == ReturnsConfig(gamma=0.999, lam=0.95, reward_scale_running=True,
                                                reward_scale_const=1.0, reward_scale_gamma=0.99)
    assert defaults["loss"] == PPOLossConfig(name="ppo", settings=None, target_kl=1.0)
    assert defaults["optim"] == DPPO_OPTIM == OptimConfig(lr=1e-4, weight_decay=0.0, max_grad_norm=0.0, mu=10,
                                                          minibatch_size=7500)
    assert defaults["critic"] == CriticConfig(lr=1e-3, vf_coef=0.5, warmup_iterations=2, hidden_dims=None)
    assert defaults["evaluation"] == EvalConfig(every=10, episodes=50, sampler=None, ddpm_std_floor=None)
    assert (defaults["num_iterations"], defaults["seed"]) == (81, 0)
    gaussian = inspect.signature(GaussianPPOModule.__init__).parameters["gaussian"].default
    assert gaussian == GaussianPolicyConfig(clip_coef=0.01, ent_coef=0.0, log_prob_reduction="sum", noise_clip=3.0)


@pytest.mark.parametrize("cls", ROBOT_GROUPS, ids=lambda cls: cls.__name__)
def test_every_field_has_a_one_line_doc_and_the_config_is_frozen(cls):
    attributes = inspect.getdoc(cls).split("Attributes:", 1)[1]
    documented = {line.strip().split(":", 1)[0] for line in attributes.splitlines()
                  if line.startswith("    ") and not line.startswith("        ")}
    assert documented == {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cls(), dataclasses.fields(cls)[0].name, None)


def test_dppo_refuses_the_optim_fields_its_update_does_not_have():
    with pytest.raises(ValueError, match=r"^optim \['lr_schedule', 'warmup_steps'\] do not apply to DPPO's update"):
        check_update_settings(OptimConfig(minibatch_size=8, warmup_steps=5, lr_schedule="cosine"))
    with pytest.raises(ValueError, match=r"^optim.minibatch_size must be set"):
        check_update_settings(OptimConfig(minibatch_size=None))
    check_update_settings(DPPO_OPTIM)  # the default passes


def test_merged_settings_merge_every_group_field_by_field():
    merged = merged_settings({"env": EnvConfig(num_envs=4), "seed": 1},
                             {"env": {"n_steps": 6}, "optim": {"mu": 2}, "seed": 2})
    assert merged["env"] == dataclasses.asdict(EnvConfig(num_envs=4, n_steps=6))
    assert merged["optim"] == {"mu": 2} and merged["seed"] == 2


# ---------------------------------------------------------------------- old checkpoints (flat hyperparameters)

# DPPOModule's 49 init arguments before the config groups
OLD_DPPO_ARGUMENTS = (
    "bc_checkpoint", "num_iterations", "task", "act_steps", "max_episode_steps", "normalizer_path", "num_envs",
    "n_steps", "ft_steps", "gamma", "gae_lambda", "gamma_denoise", "clip_base", "clip_final", "clip_rate", "loss",
    "loss_settings", "min_sampling_std", "noise_clip", "min_logprob_std", "logprob_min", "logprob_max", "actor_lr",
    "critic_lr", "weight_decay", "batch_size", "update_epochs", "vf_coef", "target_kl", "max_grad_norm",
    "n_critic_warmup_itr", "reward_scale_running", "reward_scale_const", "reward_scale_gamma", "reset_at_iteration",
    "eval_every", "eval_episodes", "eval_sampler", "eval_ddpm_std_floor", "rollout_ddim_steps", "critic_hidden_dims",
    "seed", "env_factory", "asynchronous", "max_consecutive_skips", "max_env_worker_restarts", "env_groups",
    "prefetch_reset", "skip_final_autoreset")
STAYED_TOP_LEVEL = {"bc_checkpoint", "num_iterations", "seed", "env_factory", "max_consecutive_skips"}


def test_flat_names_cover_every_old_argument_once():
    """Every old flat argument but the 5 that stayed top-level maps to one (group, field), each named once, and
    each exists; the module takes exactly the groups and the top-level arguments."""
    assert len(OLD_DPPO_ARGUMENTS) == 49
    assert set(DPPO_FLAT_NAMES) == set(OLD_DPPO_ARGUMENTS) - STAYED_TOP_LEVEL
    assert len(set(DPPO_FLAT_NAMES.values())) == 44
    assert set(inspect.signature(DPPOModule.__init__).parameters) - {"self"} == (
        STAYED_TOP_LEVEL | set(DPPOModule.config_groups))
    classes = {"env": EnvConfig, "chain": DenoisingChainConfig, "returns": ReturnsConfig, "loss": PPOLossConfig,
               "optim": OptimConfig, "critic": CriticConfig, "evaluation": EvalConfig, "gaussian": GaussianPolicyConfig}
    for group, field in {**DPPO_FLAT_NAMES, **GAUSSIAN_FLAT_NAMES}.values():
        assert field in {f.name for f in dataclasses.fields(classes[group])}, (group, field)
    assert set(DPPOModule.config_groups) == {group for group, _ in DPPO_FLAT_NAMES.values()}


def test_old_flat_hyperparameters_land_in_their_group_fields():
    old = {"bc_checkpoint": "bc.ckpt", "num_iterations": 40, "seed": 3, "num_envs": 8, "n_steps": 75,
           "max_env_worker_restarts": 5, "ft_steps": 4, "noise_clip": 2.0, "gamma": 0.99, "gae_lambda": 0.9,
           "reward_scale_const": 2.0, "loss": "cispo", "loss_settings": {"foo": 1.0}, "target_kl": None,
           "actor_lr": 1e-5, "weight_decay": 0.1, "max_grad_norm": None, "update_epochs": 3, "batch_size": 600,
           "critic_lr": 3e-3, "vf_coef": 0.25, "n_critic_warmup_itr": 0, "critic_hidden_dims": [8],
           "eval_every": 5, "eval_episodes": 7, "eval_sampler": "ddim", "eval_ddpm_std_floor": 1e-3}
    assert has_flat_hparams(old, DPPO_FLAT_NAMES)
    grouped = grouped_hparams(old, DPPO_FLAT_NAMES)
    assert grouped == {
        "bc_checkpoint": "bc.ckpt", "num_iterations": 40, "seed": 3,
        "env": {"num_envs": 8, "n_steps": 75, "max_worker_restarts": 5},
        "chain": {"ft_steps": 4, "noise_clip": 2.0},
        "returns": {"gamma": 0.99, "lam": 0.9, "reward_scale_const": 2.0},
        "loss": {"name": "cispo", "settings": {"foo": 1.0}, "target_kl": None},
        "optim": {"lr": 1e-5, "weight_decay": 0.1, "max_grad_norm": 0.0, "mu": 3, "minibatch_size": 600},
        "critic": {"lr": 3e-3, "vf_coef": 0.25, "warmup_iterations": 0, "hidden_dims": [8]},
        "evaluation": {"every": 5, "episodes": 7, "sampler": "ddim", "ddpm_std_floor": 1e-3},
    }
    assert not has_flat_hparams(grouped, DPPO_FLAT_NAMES)  # the new form (``loss`` a dict) is left alone
    assert grouped_hparams(grouped, DPPO_FLAT_NAMES) == grouped
    assert grouped_hparams({"max_grad_norm": 0.5}, DPPO_FLAT_NAMES) == {"optim": {"max_grad_norm": 0.5}}


def test_an_old_gaussian_checkpoint_keeps_its_own_settings_and_drops_the_built_chain():
    """Old GaussianPPOModule checkpoints also saved the chain DPPOModule was built with (ft_steps 1, clip_base =
    clip_final = clip_coef): those are dropped, the Gaussian's own settings go to ``gaussian``."""
    old = {"clip_coef": 0.02, "ent_coef": 0.01, "log_prob_reduction": "mean", "noise_clip": 2.5, "ft_steps": 1,
           "clip_base": 0.02, "clip_final": 0.02, "gamma_denoise": 0.99, "actor_lr": 1e-5, "batch_size": 60}
    assert grouped_hparams(old, GAUSSIAN_FLAT_NAMES) == {
        "gaussian": {"clip_coef": 0.02, "ent_coef": 0.01, "log_prob_reduction": "mean", "noise_clip": 2.5},
        "optim": {"lr": 1e-5, "minibatch_size": 60}}


# ---------------------------------------------------------------------- the shipped configs and the command line

def _print_config(capsys, *argv: str) -> dict:
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *argv, "--print_config"])
    assert exit_info.value.code == 0, capsys.readouterr().err[-2000:]
    return yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]


@pytest.mark.parametrize("name", ["dppo_lift.yaml", "dppo_can.yaml", "dppo_square.yaml", "gaussian_ppo_lift.yaml"])
def test_the_shipped_configs_parse_to_their_yaml_values_and_the_module_defaults(name, capsys):
    written = yaml.safe_load((CONFIGS / name).read_text())["model"]["init_args"]
    parsed = _print_config(capsys, "-c", str(CONFIGS / name))
    for group in ("env", "returns", "loss", "optim", "critic", "evaluation"):
        for field, value in written[group].items():
            assert parsed[group][field] == value, (group, field)
    assert (parsed["optim"]["lr"], parsed["optim"]["mu"], parsed["critic"]["lr"]) == (1e-4, 10, 1e-3)
    # the fields a config leaves out take the module's defaults, not OptimConfig's (max_grad_norm 1.0)
    assert parsed["optim"]["max_grad_norm"] == 0.0 and parsed["env"]["max_worker_restarts"] == 3
    assert parsed["optim"]["minibatch_size"] == {"gaussian_ppo_lift.yaml": 150, "dppo_square.yaml": 2000}.get(name, 1500)


def test_a_command_line_override_sets_one_field_and_keeps_the_others(capsys):
    parsed = _print_config(capsys, "-c", str(CONFIGS / "dppo_lift.yaml"), "--model.init_args.optim.lr=1e-5",
                           "--model.init_args.env.num_envs=50", "--model.init_args.chain.ft_steps=5")
    assert (parsed["optim"]["lr"], parsed["optim"]["minibatch_size"], parsed["optim"]["mu"]) == (1e-5, 1500, 10)
    assert (parsed["env"]["num_envs"], parsed["env"]["n_steps"], parsed["chain"]["ft_steps"]) == (50, 75, 5)
    assert parsed["chain"]["clip_final"] == 0.01


@pytest.mark.parametrize(("argv", "name"), [
    (["--model.init_args.optim.learning_rate=1e-5"], "learning_rate"),
    (["--model.init_args.env={num_envs: 2, workers: 3}"], "workers"),
    (["--model.init_args.actor_lr=1e-5"], "actor_lr"),  # the old flat name
])
def test_an_unknown_or_old_flat_field_is_refused_naming_it(argv, name, capsys):
    from mmpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "dppo_lift.yaml"), *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mmpo fit: error: model") and name in last
