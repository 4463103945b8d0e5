"""robomimic Square (robosuite NutAssemblySquare): the scripted expert's geometry by hand, one clean demo that puts
the nut on the peg, and ``mmpo demos --task square`` -> ``mmpo fit -c configs/robotics/bc_square.yaml`` (2 steps) ->
``mmpo fit -c configs/robotics/dppo_square.yaml`` (2 iterations) on the real simulator."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mmpo.cli import main
from mmpo.robotics.data import ChunkDataset
from mmpo.robotics.demos.experts import SquareExpert, finger_axis_yaw, quat_yaw, wrap_half_pi
from mmpo.robotics.policy.io import load_policy

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "robotics"


def _yaw_quat(yaw: float) -> np.ndarray:
    return np.array([0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2)])  # (x, y, z, w)


def test_yaw_helpers_by_hand():
    assert quat_yaw(_yaw_quat(0.3)) == pytest.approx(0.3)
    assert quat_yaw(_yaw_quat(-2.5)) == pytest.approx(-2.5)
    # the robot's start pose: pi about x (pointing down), R = diag(1, -1, -1): the closing (y) axis is world -y
    assert finger_axis_yaw(np.array([1.0, 0.0, 0.0, 0.0])) == pytest.approx(-math.pi / 2)
    # then pi/2 about world z: R[:, 1] = (1, 0, 0) -> yaw 0; q = qz(pi/2) * qx(pi) = (s, s, 0, 0), s = 1/sqrt(2)
    s = 1 / math.sqrt(2)
    assert finger_axis_yaw(np.array([s, s, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-12)
    assert wrap_half_pi(math.pi - 0.1) == pytest.approx(-0.1)
    assert wrap_half_pi(-math.pi / 2 - 0.2) == pytest.approx(math.pi / 2 - 0.2)
    assert wrap_half_pi(0.4) == pytest.approx(0.4)


def test_expert_aims_at_the_handle_and_turns_onto_it():
    expert = SquareExpert(peg=np.array([0.23, 0.1, 0.85]))
    nut_yaw = 0.5
    nut = np.array([-0.1, 0.15, 0.83])
    handle = expert.handle_pos(nut, _yaw_quat(nut_yaw))
    # handle_site at (0.054, 0, 0) in the nut frame (robosuite square-nut.xml)
    np.testing.assert_allclose(handle, nut + 0.054 * np.array([math.cos(0.5), math.sin(0.5), 0.0]))
    obs = {"robot0_eef_pos": handle + np.array([0.0, 0.0, 0.18]), "robot0_eef_quat": np.array([1.0, 0.0, 0.0, 0.0]),
           "SquareNut_pos": nut, "SquareNut_quat": _yaw_quat(nut_yaw)}
    action = expert.clean_action(obs)
    # 10 cm too high above the hover point (0.08): z = clip(2 * -0.1 / 0.05) = -1; xy already there
    np.testing.assert_allclose(action[:3], [0.0, 0.0, -1.0], atol=1e-12)
    # closing axis wanted at 0.5 + pi/2, is at -pi/2: error wrap(0.5 + pi) = 0.5 -> 2 * 0.5 / 0.5 = 2, clipped to 1
    assert action[5] == 1.0 and action[6] == -1.0 and action[3] == action[4] == 0.0
    assert expert.phase == "approach"
    expert.peg = None
    with pytest.raises(ValueError, match="peg position"):
        expert.clean_action(obs)


def test_expert_grasps_again_when_the_fingers_closed_on_nothing():
    expert = SquareExpert(peg=np.array([0.23, 0.1, 0.85]))
    nut = np.array([-0.1, 0.15, 0.83])
    obs = {"robot0_eef_pos": nut + np.array([0.054, 0.0, 0.02]), "robot0_eef_quat": np.array([1.0, 0.0, 0.0, 0.0]),
           "SquareNut_pos": nut, "SquareNut_quat": _yaw_quat(0.0), "robot0_gripper_qpos": np.array([0.015, -0.015])}
    expert._next("lift")
    for _ in range(8):  # holding the 3.2 cm handle (opening 0.03): it keeps lifting (z up, gripper closed)
        action = expert.act(obs)
    assert expert.phase == "lift" and action[2] == 1.0 and action[6] == 1.0
    obs["robot0_gripper_qpos"] = np.array([0.001, -0.001])  # closed on air
    for attempt in range(1, 4):
        expert._next("lift")
        for _ in range(6):  # the first 6 steps of a lift are left to the closing fingers
            assert expert.phase == "lift"
            expert.act(obs)
        action = expert.act(obs)
        assert expert.phase == "approach" and action[6] == -1.0 and expert.regrasps == attempt
    expert._next("lift")  # after 3 retries it carries on
    for _ in range(8):
        expert.act(obs)
    assert expert.phase == "lift" and expert.regrasps == 3
    expert.reset()
    assert expert.regrasps == 0


def _run_dirs(root: Path) -> list[str]:
    return [
        "--trainer.default_root_dir", str(root),
        "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"),
        "--trainer.enable_progress_bar", "false",
    ]


@pytest.fixture(scope="module")
def square_demos(tmp_path_factory) -> Path:
    demos = tmp_path_factory.mktemp("demos") / "square.hdf5"
    assert main(["demos", "--task", "square", "--num-demos", "1", "--noise", "0.0", "--out", str(demos),
                 "--no-progress", "--seed", "0"]) == 0
    return demos


def test_clean_expert_puts_the_nut_on_the_peg(square_demos):
    stats = __import__("json").loads(Path(f"{square_demos}.stats.json").read_text())
    assert stats["task"] == "square"
    with h5py.File(square_demos, "r") as handle:
        assert len(handle["data"]) == 1
        demo = handle["data"]["demo_0"]
        assert demo["obs"]["object"].shape[1] == 14
        # success reached: sparse reward 1 at the end, and the episode is well inside the 400-step limit
        assert demo["rewards"][-1] == 1.0 and demo["dones"][-1] == 1 and 60 < len(demo["actions"]) < 400
        actions = demo["actions"][:]
        closed = np.nonzero(actions[:, 6] > 0)[0]
        assert closed.size and np.any(actions[closed[-1] + 1:, 6] < 0)  # grasp, then release
        assert np.any(actions[:, 5] != 0)  # the gripper turned onto the handle
        nut = demo["obs"]["object"][:]
        # robosuite's object-state order: SquareNut_to_eef_pos (3), _quat (4), SquareNut_pos (3), _quat (4);
        # the nut ends on the square peg (0.23, 0.1): within 3 cm, below table + 5 cm
        assert abs(nut[-1, 7] - 0.23) < 0.03 and abs(nut[-1, 8] - 0.1) < 0.03 and nut[-1, 9] < 0.87
    dataset = ChunkDataset(square_demos, horizon=4)
    assert dataset.obs_dim == 23


@pytest.fixture(scope="module")
def square_bc_checkpoint(square_demos, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bc_square")
    # one ~120-step demo = one batch of 256 per epoch: 2 epochs = 2 optimizer steps
    main(["fit", "-c", str(CONFIGS / "bc_square.yaml"), "--data.init_args.dataset_path", str(square_demos),
          "--trainer.max_epochs", "2", "--model.init_args.hidden_dims", "[32, 32, 32]", *_run_dirs(root)])
    return root / "checkpoints" / "last.ckpt"


def test_bc_square_fit_writes_a_square_policy(square_bc_checkpoint):
    checkpoint = torch.load(square_bc_checkpoint, weights_only=True)
    assert checkpoint["global_step"] == 2
    policy, metadata = load_policy(square_bc_checkpoint)
    assert metadata["kind"] == "bc" and metadata["task"] == "square"
    assert (policy.obs_dim, policy.action_dim, policy.horizon) == (23, 7, 4)


def test_dppo_square_fit_runs_two_iterations(square_bc_checkpoint, tmp_path):
    root = tmp_path / "dppo_square"
    main(["fit", "-c", str(CONFIGS / "dppo_square.yaml"), "--model.init_args.bc_checkpoint",
          str(square_bc_checkpoint), "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
          "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
          "--model.init_args.env.asynchronous", "false", "--model.init_args.optim.minibatch_size", "30",
          "--model.init_args.optim.mu", "1", "--model.init_args.critic.warmup_iterations", "1",
          "--model.init_args.evaluation.every", "1", "--model.init_args.evaluation.episodes", "2", *_run_dirs(root)])
    last = root / "checkpoints" / "last.ckpt"
    policy, metadata = load_policy(last)
    assert metadata["kind"] == "dppo" and metadata["task"] == "square" and metadata["ft_steps"] == 10
    saved = torch.load(last, weights_only=True)["hyper_parameters"]
    assert saved["optim"]["lr"] == 1e-4 and saved["critic"]["lr"] == 1e-3 and saved["returns"]["gamma"] == 0.999
    rows = [{k: float(v) for k, v in r.items() if v}
            for r in csv.DictReader(sorted(root.rglob("metrics.csv"))[0].open())]
    # 2 iterations x 2 envs x 3 chunk steps x 4 actions
    assert [r["charts/iteration"] for r in rows] == [0.0, 1.0]
    assert [r["perf/env_steps_total"] for r in rows] == [24.0, 48.0]
    assert rows[0]["policy/approx_kl"] == pytest.approx(0.0, abs=1e-12)  # critic warm-up: the actor is still
