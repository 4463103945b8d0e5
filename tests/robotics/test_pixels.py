"""Pixel observations: the image encoder by hand, the lift_img task's flat [proprio; wrist frame] observation, its
demos' stats, and ``mmpo demos --task lift_img`` -> ``mmpo fit -c configs/robotics/bc_lift_img.yaml`` (2 steps) ->
``mmpo fit -c configs/robotics/dppo_lift.yaml`` from that checkpoint (2 iterations, the critic with its own encoder)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmpo.cli import main
from mmpo.robotics.envs import TaskSpec, get_task, make_env, register_task
from mmpo.robotics.policy import DiffusionPolicy
from mmpo.robotics.policy.io import load_policy
from mmpo.robotics.policy.networks import CriticMLP, EncodedDenoiser, ImageEncoder

torch.set_num_threads(1)
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "robotics"


def test_image_encoder_splits_proprio_and_reads_pixels_in_hwc_order():
    torch.manual_seed(0)
    encoder = ImageEncoder(2 + 3 * 16 * 16, 16, channels=4, feature_dim=5)
    # 16 -> conv 8/4: 3 -> conv 3/2: 1 patch; features = Linear(4 -> 5)
    assert (encoder.proprio_dim, encoder.out_dim, encoder.project.in_features) == (2, 7, 4)
    image = np.random.default_rng(0).uniform(-1, 1, size=(3, 16, 16, 3)).astype(np.float32)  # (B, H, W, C)
    obs = torch.cat([torch.tensor([[0.5, -0.5]] * 3), torch.from_numpy(image.reshape(3, -1))], dim=1)
    out = encoder(obs)
    assert torch.equal(out[:, :2], obs[:, :2])  # proprio passes through
    chw = torch.from_numpy(image).permute(0, 3, 1, 2)  # by hand: channel c of pixel (h, w) is image[b, h, w, c]
    conv1, conv2 = encoder.patches[0], encoder.patches[2]
    hidden = F.relu(F.conv2d(F.relu(F.conv2d(chw, conv1.weight, conv1.bias, stride=4)), conv2.weight, conv2.bias,
                             stride=2))
    expected = F.linear(hidden.flatten(1), encoder.project.weight, encoder.project.bias)
    assert torch.allclose(out[:, 2:], expected, atol=1e-6)
    with pytest.raises(ValueError, match="needs image_size >= 11"):
        ImageEncoder(100, 16)


def test_image_policy_and_critic_condition_on_encoded_pixels():
    torch.manual_seed(0)
    settings = {"image_size": 16, "channels": 4, "feature_dim": 6}
    policy = DiffusionPolicy(3 + 768, 2, 4, denoising_steps=5, hidden_dims=[16], image_encoder=settings)
    assert isinstance(policy.network, EncodedDenoiser) and policy.policy_config["image_encoder"] == settings
    # the denoiser sees [proprio (3); 6 features] = 9 state inputs: chunk 8 + time 16 + 9
    assert policy.network.denoiser.body.input.in_features == 8 + 16 + 9
    obs = torch.rand(5, 771) * 2 - 1
    assert policy.sample(obs, deterministic=True).actions.shape == (5, 4, 2)
    changed = obs.clone()
    changed[:, 3 + 100] += 0.5  # one pixel value: the chunk changes through the encoder
    noise = [torch.randn(5, 4, 2)]
    assert not torch.equal(policy.sample(obs, deterministic=True, initial_noise=noise[0]).actions,
                           policy.sample(changed, deterministic=True, initial_noise=noise[0]).actions)
    critic = CriticMLP(771, [16], image_encoder=settings)
    assert critic.encoder is not None and critic.body.input.in_features == 9 and critic(obs).shape == (5,)


def test_camera_tasks_are_checked_when_registered():
    with pytest.raises(ValueError, match="a camera task needs"):
        register_task(TaskSpec("bad_img", "robosuite", "Lift", ("robot0_eef_pos",), 10, 3 + 3 * 16 * 16, 7,
                               camera="agentview", image_size=16))
    spec = get_task("lift_img")
    assert (spec.camera, spec.image_size, spec.obs_dim, spec.image_dims) == ("robot0_eye_in_hand", 32, 3081, 3072)


def test_lift_img_observation_is_proprio_then_the_upright_wrist_frame():
    env = make_env("lift_img", seed=0, max_episode_steps=5)
    try:
        obs, _ = env.reset(seed=0)
        raw = env.unwrapped.last_raw_obs
        assert obs.shape == (3081,) and obs.dtype == np.float32
        proprio = np.concatenate([raw["robot0_eef_pos"], raw["robot0_eef_quat"], raw["robot0_gripper_qpos"]])
        np.testing.assert_allclose(obs[:9], proprio, rtol=1e-6)
        frame = raw["robot0_eye_in_hand_image"]
        assert frame.shape == (32, 32, 3)
        np.testing.assert_array_equal(obs[9:], frame[::-1].reshape(-1).astype(np.float32))  # flipped upright
    finally:
        env.close()


def _run_dirs(root: Path) -> list[str]:
    return ["--trainer.default_root_dir", str(root), "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"), "--trainer.enable_progress_bar",
            "false"]


@pytest.fixture(scope="module")
def lift_img_bc(tmp_path_factory) -> Path:
    demos = tmp_path_factory.mktemp("demos") / "lift_img.hdf5"
    assert main(["demos", "--task", "lift_img", "--num-demos", "1", "--noise", "0.0", "--out", str(demos),
                 "--no-progress"]) == 0
    stats = json.loads(Path(f"{demos}.stats.json").read_text())
    # pixels keep the fixed range [0, 255]; the proprio's range is the data's
    assert stats["obs_min"][9:] == [0.0] * 3072 and stats["obs_max"][9:] == [255.0] * 3072
    assert stats["obs_keys"][-1] == "robot0_eye_in_hand_image" and stats["obs_min"][0] != 0.0
    root = tmp_path_factory.mktemp("bc_lift_img")
    # one ~35-step demo = one batch per epoch: 2 epochs = 2 optimizer steps
    main(["fit", "-c", str(CONFIGS / "bc_lift_img.yaml"), "--data.init_args.dataset_path", str(demos),
          "--trainer.max_epochs", "2", "--model.init_args.hidden_dims", "[32, 32, 32]",
          "--model.init_args.image_encoder.channels", "8", *_run_dirs(root)])
    return root / "checkpoints" / "last.ckpt"


def test_bc_lift_img_fit_writes_an_image_policy(lift_img_bc):
    checkpoint = torch.load(lift_img_bc, weights_only=True)
    assert checkpoint["global_step"] == 2
    policy, metadata = load_policy(lift_img_bc)
    assert metadata["task"] == "lift_img" and policy.obs_dim == 3081
    assert policy.policy_config["image_encoder"] == {"image_size": 32, "channels": 8, "feature_dim": 64}
    assert isinstance(policy.network, EncodedDenoiser)


def test_dppo_fine_tunes_the_image_policy_for_two_iterations(lift_img_bc, tmp_path):
    root = tmp_path / "dppo_lift_img"
    main(["fit", "-c", str(CONFIGS / "dppo_lift.yaml"), "--model.init_args.bc_checkpoint", str(lift_img_bc),
          "--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
          "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "12",
          "--model.init_args.env.asynchronous", "false", "--model.init_args.optim.minibatch_size", "30",
          "--model.init_args.optim.mu", "1", "--model.init_args.critic.warmup_iterations", "1",
          "--model.init_args.evaluation.every", "1", "--model.init_args.evaluation.episodes", "2", *_run_dirs(root)])
    last = root / "checkpoints" / "last.ckpt"
    policy, metadata = load_policy(last)
    assert metadata["kind"] == "dppo" and metadata["task"] == "lift_img" and policy.ft_network is not None
    state = torch.load(last, weights_only=True)["state_dict"]
    assert any(k.startswith("critic.encoder.") for k in state)  # the critic's own encoder
    rows = [{k: float(v) for k, v in r.items() if v}
            for r in csv.DictReader(sorted(root.rglob("metrics.csv"))[0].open())]
    assert [r["perf/env_steps_total"] for r in rows] == [24.0, 48.0]
    assert [(r["eval/episodes"], r["eval/episode_length"]) for r in rows] == [(2.0, 12.0)] * 2
