"""Checkpoints written before the typed configs and the package move resume under today's names."""

from __future__ import annotations

from mmpo.training.legacy_hparams import flat_to_grouped_for, upgrade_class_path, upgrade_saved_hparams
from mmpo.training.resume_args import fixed_args_for, hparam_differences, resume_conflicts

GRPO = "mmpo.algos.grpo.GRPOModule"


def test_old_package_paths_become_mmpo_subpackages():
    assert upgrade_class_path("dllm.rl.DiffuGRPO") == "mmpo.dllm.rl.DiffuGRPO"
    assert upgrade_class_path("robotics.bc.ChunkDataModule") == "mmpo.robotics.bc.ChunkDataModule"
    assert upgrade_class_path("mmpo.algos.grpo.GRPOModule") == GRPO
    assert upgrade_class_path("mydllm.rl.Mine") == "mydllm.rl.Mine"


def test_flat_vlm_arguments_move_into_their_groups_and_group_fields_win():
    saved = {"_class_path": GRPO, "model_path": "m", "num_generations": 4, "lr": 1e-4, "beta": 0.0,
             "loss": "gspo", "rollout_is": "token_mask", "optim": {"mu": 2, "lr": 5e-5}}
    upgraded = upgrade_saved_hparams(saved)
    assert upgraded == {"_class_path": GRPO, "model_path": "m", "sampling": {"num_generations": 4},
                        "loss": {"beta": 0.0, "name": "gspo"}, "rollout_correction": {"mode": "token_mask"},
                        "optim": {"mu": 2, "lr": 5e-5}}  # a value already in its group is the newer one
    assert saved["num_generations"] == 4  # a copy: the checkpoint's dict is untouched
    assert upgrade_saved_hparams(upgraded) == upgraded


def test_modules_that_still_take_a_flat_argument_keep_it():
    rows = flat_to_grouped_for(GRPO)
    assert rows["num_generations"] == ("sampling", "num_generations") and rows["reward_weights"] == ("rewards", "weights")
    # BCModule takes lr flat: nothing of the VLM table applies to it
    assert flat_to_grouped_for("mmpo.robotics.bc.BCModule") == {}
    saved = {"_class_path": "robotics.bc.BCModule", "lr": 1e-4}
    assert upgrade_saved_hparams(saved) == {"_class_path": "mmpo.robotics.bc.BCModule", "lr": 1e-4}


def test_an_old_checkpoints_group_size_is_still_a_fixed_argument():
    """Without the upgrade the flat ``num_generations`` had no counterpart and a changed group size resumed."""
    old = {"_class_path": GRPO, "model_path": "m", "num_generations": 2}
    now = {"class_path": GRPO, "init_args": {"model_path": "m", "sampling": {"num_generations": 3}}}
    fixed = fixed_args_for(GRPO)
    assert resume_conflicts(hparam_differences(old, now, "model"), fixed) == []  # the gap
    assert resume_conflicts(hparam_differences(upgrade_saved_hparams(old), now, "model"), fixed) == [
        ("model.init_args.sampling.num_generations", 2, 3)]


def test_an_old_class_path_is_not_a_model_change():
    old = {"_class_path": "dllm.rl.DiffuGRPO", "model_path": "m"}
    now = {"class_path": "mmpo.dllm.rl.DiffuGRPO", "init_args": {"model_path": "m"}}
    assert [d[0] for d in hparam_differences(old, now, "model")] == ["model.class_path"]
    assert hparam_differences(upgrade_saved_hparams(old), now, "model") == []


def test_old_flat_dppo_and_gaussian_arguments_move_into_their_groups():
    saved = {"_class_path": "robotics.dppo.DPPOModule", "bc_checkpoint": "bc.ckpt", "actor_lr": 3e-5,
             "update_epochs": 5, "gamma": 0.99, "ft_steps": 10, "eval_every": 0}
    assert upgrade_saved_hparams(saved) == {
        "_class_path": "mmpo.robotics.dppo.DPPOModule", "bc_checkpoint": "bc.ckpt",
        "optim": {"lr": 3e-5, "mu": 5}, "returns": {"gamma": 0.99}, "chain": {"ft_steps": 10},
        "evaluation": {"every": 0}}
    gaussian = {"_class_path": "mmpo.robotics.gaussian_ppo.GaussianPPOModule", "noise_clip": 3.0, "clip_coef": 0.2}
    assert upgrade_saved_hparams(gaussian)["gaussian"] == {"noise_clip": 3.0, "clip_coef": 0.2}


def test_old_flat_dllm_arguments_take_the_dllm_mapping():
    saved = {"_class_path": "dllm.rl.DiffuGRPO", "model_path": "m", "group_size": 8, "inner_updates": 4,
             "lr": 5e-7, "ratio_level": "token", "correct_reward": 3.0}
    upgraded = upgrade_saved_hparams(saved)
    assert upgraded["_class_path"] == "mmpo.dllm.rl.DiffuGRPO" and upgraded["group_size"] == 8
    assert upgraded["optim"] == {"mu": 4, "lr": 5e-7}
    assert upgraded["loss"] == {"name": "ppo"} and upgraded["rewards"] == {"weights": {"correct": 3.0}}
    assert upgrade_saved_hparams(upgraded) == upgraded
