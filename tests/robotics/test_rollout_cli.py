"""Smoke runs on real robosuite Lift of the documented command sequence, in-process and tiny:
``mmpo demos`` -> ``mmpo fit -c configs/robotics/bc_lift.yaml`` -> ``mmpo fit -c configs/robotics/dppo_lift.yaml``
-> ``mmpo rollout --video``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
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
def lift_demos(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    assert main(["demos", "--task", "lift", "--num-demos", "1", "--noise", "0.05", "--out", str(path), "--no-progress"]) == 0
    return path


@pytest.fixture(scope="module")
def bc_checkpoint(lift_demos, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bc")
    main(["fit", "-c", str(CONFIGS / "bc_lift.yaml"), "--data.init_args.dataset_path", str(lift_demos),
          "--trainer.max_epochs", "2", "--model.init_args.hidden_dims", "[32, 32, 32]", *_run_dirs(root)])
    return root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def dppo_checkpoint(bc_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dppo")
    main(["fit", "-c", str(CONFIGS / "dppo_lift.yaml"), "--model.init_args.bc_checkpoint", str(bc_checkpoint),
          "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
          "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
          "--model.init_args.optim.minibatch_size", "30", "--model.init_args.optim.mu", "1",
          "--model.init_args.critic.warmup_iterations", "1", "--model.init_args.evaluation.every", "1",
          "--model.init_args.evaluation.episodes", "2", "--model.init_args.env.asynchronous", "false", *_run_dirs(root)])
    return root / "checkpoints" / "last.ckpt"


def test_bc_fit_from_config_writes_checkpoint_and_safetensors(bc_checkpoint, lift_demos):
    policy, metadata = load_policy(bc_checkpoint)
    assert metadata["kind"] == "bc" and metadata["task"] == "lift"
    assert metadata["normalizer_path"] == f"{lift_demos}.stats.json"
    assert (policy.obs_dim, policy.action_dim, policy.horizon) == (19, 7, 4)
    exported = sorted(bc_checkpoint.parents[1].rglob("policy.safetensors"))
    assert exported, "BC should export the EMA policy as safetensors"
    same, _ = load_policy(exported[0])
    for a, b in zip(policy.state_dict().values(), same.state_dict().values()):
        assert torch.equal(a, b)


def test_bc_fit_without_demos_says_how_to_make_them(tmp_path):
    missing = tmp_path / "nope.hdf5"
    with pytest.raises(FileNotFoundError, match="mmpo demos --task lift"):
        main(["fit", "-c", str(CONFIGS / "bc_lift.yaml"), "--data.init_args.dataset_path", str(missing),
              "--trainer.max_epochs", "1", *_run_dirs(tmp_path)])


def test_dppo_fit_from_config_logs_metrics_and_checkpoints(dppo_checkpoint):
    policy, metadata = load_policy(dppo_checkpoint)
    assert metadata["kind"] == "dppo" and metadata["ft_steps"] == 10 and policy.ft_network is not None
    metrics_files = sorted(dppo_checkpoint.parents[1].rglob("metrics.csv"))
    header = metrics_files[0].read_text().splitlines()[0].split(",")
    for key in ("charts/return", "charts/success_rate", "losses/policy", "losses/value", "policy/clipfrac",
                "policy/approx_kl", "perf/env_steps_per_s", "eval/success_rate"):
        assert key in header, key
    rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(metrics_files[0].open())]
    # 2 iterations x 2 envs x 3 chunk steps x 4 actions; each 12-step episode ends with its iteration
    assert [r["charts/iteration"] for r in rows] == [0.0, 1.0]
    assert [r["perf/env_steps_total"] for r in rows] == [24.0, 48.0]
    assert [r["charts/episodes"] for r in rows] == [2.0, 2.0]
    assert [(r["eval/episodes"], r["eval/episode_length"], r["eval/env_steps"]) for r in rows] == [(2.0, 12.0, 24.0)] * 2
    assert [r["perf/faults"] for r in rows] == [0.0, 0.0]
    # iteration 0 is the critic warm-up: the actor does not move, so every ratio stays 1
    assert rows[0]["policy/approx_kl"] == pytest.approx(0.0, abs=1e-12) and rows[0]["policy/clipfrac"] == 0.0
    # every iteration's first minibatch is scored before any actor step of that iteration: ratio 1
    assert all(r["policy/ratio_first_minibatch_maxdev"] < 1e-5 for r in rows)


def test_rollout_cli_records_a_video(dppo_checkpoint, tmp_path, capsys):
    """One frame per control step (not per 4-step chunk), 256x256 from robosuite's frontview, 20 fps."""
    video = tmp_path / "lift.mp4"
    code = main(["rollout", "--ckpt", str(dppo_checkpoint), "--task", "lift", "--episodes", "1",
                 "--max-episode-steps", "2", "--video", str(video)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # reset + 2 control steps (the time limit cuts the 4-step chunk after 2)
    assert summary["kind"] == "dppo" and summary["episodes"] == 1 and summary["frames"] == 3
    assert summary["fps"] == 20.0 and summary["episode_length_mean"] == 2.0
    import imageio.v2 as imageio

    reader = imageio.get_reader(video)
    fps = reader.get_meta_data()["fps"]
    frames = [np.asarray(frame) for frame in reader.iter_data()]
    reader.close()
    assert fps == 20.0  # the Lift control frequency: the video plays in real time
    assert len(frames) == 3 and frames[0].shape == (256, 256, 3)
    assert frames[0].std() > 0  # a real rendered scene, not a blank frame
    assert not list(tmp_path.glob(".*partial*"))  # the temporary file was renamed into place


def test_rollout_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["rollout", "--ckpt", str(tmp_path / "missing.ckpt")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bc_lift", "dppo_lift", "bc_can", "dppo_can", "bc_square", "dppo_square"])
def test_configs_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: mmpo.robotics." in printed
