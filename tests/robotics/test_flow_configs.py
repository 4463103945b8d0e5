"""`mmpo fit` of the flow-policy configs at a tiny size: flow BC on Lift-shaped demos (2 steps), then ReinFlow and
FPO on Hopper (in-process envs) from a flow BC checkpoint, 3 iterations each, resumed from the iteration-1
checkpoint to the bit-identical end state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.robotics.flow_bc import FlowBCModule
from mmpo.robotics.policy.flow import FlowPolicy
from mmpo.robotics.policy.io import load_policy
from reliability.test_resume_robotics import assert_same_tensors, training_state, write_tiny_demos

REPO = Path(__file__).resolve().parents[2]

torch.set_num_threads(1)


def _cli_args(config: str, root: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(REPO / "configs" / "robotics" / config), "--trainer.default_root_dir", str(root),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"), *extra]


def test_flow_bc_lift_config_trains_two_steps(tmp_path):
    demos = write_tiny_demos(tmp_path / "lift.hdf5")
    main(_cli_args("flow_bc_lift.yaml", tmp_path / "flow_bc", "--data.init_args.dataset_path", str(demos),
                   "--data.init_args.batch_size", "32", "--model.init_args.hidden_dims", "[16, 16, 16]",
                   "--trainer.max_epochs", "1"))
    last = tmp_path / "flow_bc" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2  # 3 x 20-step demos in batches of 32: 2 batches
    policy, metadata = load_policy(last)
    assert isinstance(policy, FlowPolicy) and metadata["kind"] == "flow_bc" and metadata["task"] == "lift"
    assert (policy.obs_dim, policy.action_dim, policy.horizon, policy.num_steps) == (19, 7, 4, 4)


@pytest.fixture(scope="module")
def hopper_flow_bc(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    bc = FlowBCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, hidden_dims=[8], task="hopper")
    path = tmp_path_factory.mktemp("hopper") / "flow_bc_hopper.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, path)
    return path


@pytest.mark.parametrize("config,group", [("reinflow_lift.yaml", ["--model.init_args.reinflow.noise_hidden_dims", "[8]"]),
                                          ("fpo_lift.yaml", ["--model.init_args.fpo.mc_samples", "4"])])
def test_config_fits_three_iterations_and_resumes_bit_exactly(hopper_flow_bc, tmp_path, config, group):
    args = ["--model.init_args.bc_checkpoint", str(hopper_flow_bc), "--model.init_args.env.task", "hopper",
            "--model.init_args.num_iterations", "3", "--model.init_args.env.num_envs", "2",
            "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "8",
            "--model.init_args.optim.minibatch_size", "3", "--model.init_args.optim.mu", "1",
            "--model.init_args.critic.warmup_iterations", "1", "--model.init_args.loss.target_kl", "null",
            "--model.init_args.evaluation.every", "2", "--model.init_args.evaluation.episodes", "2",
            "--model.init_args.critic.hidden_dims", "[8]", "--model.init_args.env.asynchronous", "false",
            "--trainer.callbacks.init_args.filename", "{step}", "--trainer.callbacks.init_args.every_n_train_steps", "1",
            *group]
    main(_cli_args(config, tmp_path / "full", *args))
    last = tmp_path / "full" / "checkpoints" / "last.ckpt"
    # optimizer steps: iteration 0 (critic warm-up) 2 minibatches (6 env steps / 3) x the critic; iterations 1, 2:
    # 2 minibatches x 2 optimizers
    assert torch.load(last, weights_only=True)["global_step"] == 10
    first = tmp_path / "full" / "checkpoints" / "step=2.ckpt"
    assert torch.load(first, weights_only=True)["dppo_state"]["iteration"] == 1
    main(_cli_args(config, tmp_path / "resumed", *args, "--ckpt_path", str(first)))
    expected = training_state(last)
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["iteration"] == 3 and expected["dppo_state"]["env_steps"] == 3 * 2 * 3 * 2
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])
    policy, metadata = load_policy(last)
    assert isinstance(policy, FlowPolicy) and metadata["kind"] == config.split("_")[0]
    saved = torch.load(last, weights_only=True)["hyper_parameters"]
    # the YAML's official settings reached the module next to the overrides
    if config.startswith("reinflow"):
        assert saved["reinflow"]["clip"] == 0.01 and saved["reinflow"]["noise_hidden_dims"] == [8]
        assert saved["optim"]["lr"] == 2e-5 and saved["critic"]["lr"] == 6.5e-4
    else:
        assert saved["fpo"] == {"mc_samples": 4, "clip": 0.05, "output_mode": "u_but_supervise_as_eps",
                                "discretize_t": True}


@pytest.fixture(scope="module")
def lift_flow_bc(tmp_path_factory) -> Path:
    """``mmpo fit -c configs/robotics/flow_bc_lift.yaml`` for 1 epoch (2 steps) on tiny random Lift-shaped demos."""
    root = tmp_path_factory.mktemp("lift_flow_bc")
    demos = write_tiny_demos(root / "lift.hdf5")
    main(_cli_args("flow_bc_lift.yaml", root / "bc", "--data.init_args.dataset_path", str(demos),
                   "--data.init_args.batch_size", "32", "--model.init_args.hidden_dims", "[16, 16, 16]",
                   "--trainer.max_epochs", "1"))
    return root / "bc" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("config,extra", [
    ("reinflow_lift.yaml", ["--model.init_args.reinflow.noise_hidden_dims", "[8]", "--model.init_args.optim.minibatch_size", "3"]),
    ("fpo_lift.yaml", ["--model.init_args.optim.minibatch_size", "3"]),
    ("dsrl_lift.yaml", ["--model.init_args.dsrl.hidden_dims", "[16]", "--model.init_args.dsrl.utd", "1",
                        "--model.init_args.dsrl.warmup_chunk_steps", "3", "--model.init_args.optim.minibatch_size", "4"]),
    ("dsrl_na_lift.yaml", ["--model.init_args.dsrl.hidden_dims", "[16]", "--model.init_args.dsrl.utd", "1",
                           "--model.init_args.dsrl.noise_critic_grad_steps", "2",
                           "--model.init_args.dsrl.warmup_chunk_steps", "3", "--model.init_args.optim.minibatch_size", "4"]),
])
def test_lift_configs_train_two_iterations_on_robosuite_lift(lift_flow_bc, tmp_path, config, extra):
    """Each config on its own task (robosuite Lift, in-process) from the flow BC checkpoint: 2 iterations."""
    root = tmp_path / config.split(".")[0]
    main(_cli_args(config, root, "--model.init_args.bc_checkpoint", str(lift_flow_bc),
                   "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
                   "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
                   "--model.init_args.env.asynchronous", "false", "--model.init_args.evaluation.every", "1",
                   "--model.init_args.evaluation.episodes", "2", *extra))
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["dppo_state"]["iteration"] == 2 and checkpoint["robotics"]["task"] == "lift"
    assert checkpoint["dppo_state"]["env_steps"] == 2 * 2 * 3 * 4  # iterations x envs x chunk steps x act_steps
    assert checkpoint["global_step"] > 0
    if config == "dsrl_na_lift.yaml":  # iteration 1: 3 chunk steps x (1 SAC step x 3 optimizers + 2 distillation steps)
        assert checkpoint["global_step"] == 3 * (3 + 2)
