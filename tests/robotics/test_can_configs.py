"""Tiny `mmpo fit` runs of the Can configs on real robosuite PickPlaceCan, in-process: ``mmpo demos --task can``
-> ``mmpo fit -c configs/robotics/bc_can.yaml`` (2 steps) -> ``mmpo fit -c configs/robotics/dppo_can.yaml``
(2 iterations, with a command-line override of a config group's field); a flow BC on the same demos
(``flow_bc_lift.yaml`` with Can's dimensions) -> ``mmpo fit -c configs/robotics/fpo_can.yaml`` (2 iterations)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.robotics.policy.io import load_policy

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "robotics"


def _run_dirs(root: Path) -> list[str]:
    return [
        "--trainer.default_root_dir", str(root),
        "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"),
        "--trainer.enable_progress_bar", "false",
    ]


@pytest.fixture(scope="module")
def can_demos(tmp_path_factory) -> Path:
    demos = tmp_path_factory.mktemp("demos") / "can.hdf5"
    assert main(["demos", "--task", "can", "--num-demos", "1", "--noise", "0.05", "--out", str(demos),
                 "--no-progress"]) == 0
    return demos


@pytest.fixture(scope="module")
def can_bc_checkpoint(can_demos, tmp_path_factory) -> Path:
    demos = can_demos
    root = tmp_path_factory.mktemp("bc_can")
    # one ~170-step demo = one batch of 256 per epoch: 2 epochs = 2 optimizer steps
    main(["fit", "-c", str(CONFIGS / "bc_can.yaml"), "--data.init_args.dataset_path", str(demos),
          "--trainer.max_epochs", "2", "--model.init_args.hidden_dims", "[32, 32, 32]", *_run_dirs(root)])
    return root / "checkpoints" / "last.ckpt"


def test_bc_can_fit_writes_a_can_policy(can_bc_checkpoint):
    checkpoint = torch.load(can_bc_checkpoint, weights_only=True)
    assert checkpoint["global_step"] == 2
    policy, metadata = load_policy(can_bc_checkpoint)
    assert metadata["kind"] == "bc" and metadata["task"] == "can"
    assert (policy.obs_dim, policy.action_dim, policy.horizon) == (23, 7, 4)


def test_dppo_can_fit_runs_two_iterations_with_a_group_override(can_bc_checkpoint, tmp_path):
    root = tmp_path / "dppo_can"
    main(["fit", "-c", str(CONFIGS / "dppo_can.yaml"), "--model.init_args.bc_checkpoint", str(can_bc_checkpoint),
          "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
          "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
          "--model.init_args.env.asynchronous", "false", "--model.init_args.optim.minibatch_size", "30",
          "--model.init_args.optim.mu", "1", "--model.init_args.optim.lr=3e-5",
          "--model.init_args.critic.warmup_iterations", "1", "--model.init_args.evaluation.every", "1",
          "--model.init_args.evaluation.episodes", "2", *_run_dirs(root)])
    last = root / "checkpoints" / "last.ckpt"
    policy, metadata = load_policy(last)
    assert metadata["kind"] == "dppo" and metadata["task"] == "can" and metadata["ft_steps"] == 10
    assert policy.obs_dim == 23 and policy.ft_network is not None
    checkpoint = torch.load(last, weights_only=True)
    saved = checkpoint["hyper_parameters"]
    # the override and the YAML's other optim fields are what the module was built with
    assert saved["optim"]["lr"] == 3e-5 and (saved["optim"]["minibatch_size"], saved["optim"]["mu"]) == (30, 1)
    assert saved["critic"]["lr"] == 1e-3 and saved["chain"]["clip_final"] == 0.01 and saved["env"]["num_envs"] == 2
    actor_state, critic_state = checkpoint["optimizer_states"]
    assert actor_state["param_groups"][0]["lr"] == 3e-5 and critic_state["param_groups"][0]["lr"] == 1e-3
    rows = [{k: float(v) for k, v in r.items() if v}
            for r in csv.DictReader(sorted(root.rglob("metrics.csv"))[0].open())]
    # 2 iterations x 2 envs x 3 chunk steps x 4 actions; each 12-step episode ends with its iteration
    assert [r["charts/iteration"] for r in rows] == [0.0, 1.0]
    assert [r["perf/env_steps_total"] for r in rows] == [24.0, 48.0]
    assert [(r["eval/episodes"], r["eval/episode_length"]) for r in rows] == [(2.0, 12.0)] * 2
    # iteration 0 is the critic warm-up: the actor does not move, so every ratio stays 1
    assert rows[0]["policy/approx_kl"] == pytest.approx(0.0, abs=1e-12)


FPO_CAN_LR = 3e-5  # configs/robotics/fpo_can.yaml


def test_fpo_can_fit_runs_two_iterations_from_a_can_flow_bc(can_demos, tmp_path):
    bc_root = tmp_path / "flow_bc_can"
    main(["fit", "-c", str(CONFIGS / "flow_bc_lift.yaml"), "--data.init_args.dataset_path", str(can_demos),
          "--trainer.max_epochs", "2", "--model.init_args.hidden_dims", "[32, 32, 32]", "--model.init_args.obs_dim",
          "23", "--model.init_args.task", "can", *_run_dirs(bc_root)])
    root = tmp_path / "fpo_can"
    main(["fit", "-c", str(CONFIGS / "fpo_can.yaml"),
          "--model.init_args.bc_checkpoint", str(bc_root / "checkpoints" / "last.ckpt"),
          "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
          "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
          "--model.init_args.env.asynchronous", "false", "--model.init_args.optim.minibatch_size", "6",
          "--model.init_args.optim.mu", "1", "--model.init_args.fpo.mc_samples", "2",
          "--model.init_args.critic.warmup_iterations", "1", "--model.init_args.evaluation.every", "1",
          "--model.init_args.evaluation.episodes", "2", *_run_dirs(root)])
    last = root / "checkpoints" / "last.ckpt"
    policy, metadata = load_policy(last)
    assert metadata["kind"] == "fpo" and metadata["task"] == "can" and policy.obs_dim == 23
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["dppo_state"]["iteration"] == 2 and checkpoint["dppo_state"]["env_steps"] == 2 * 2 * 3 * 4
    saved = checkpoint["hyper_parameters"]
    # the Can actor lr chosen on validation episodes (bench/RESULTS.md "flow can fpo"), the rest fpo_lift.yaml's
    assert saved["optim"]["lr"] == FPO_CAN_LR and saved["fpo"]["clip"] == 0.05 and saved["critic"]["lr"] == 1e-3
    actor_state = checkpoint["optimizer_states"][0]
    assert actor_state["param_groups"][0]["lr"] == FPO_CAN_LR
