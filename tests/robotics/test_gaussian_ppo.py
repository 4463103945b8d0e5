"""Gaussian-policy PPO baseline (robotics/gaussian_ppo.py): its log-prob and entropy by hand, BC of the
mean, and a 2-iteration PPO run on the tiny reach task of test_dppo.py."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from robotics.gaussian_ppo import GaussianBCModule, GaussianChunkPolicy, GaussianPPOModule, load_gaussian_policy
from robotics.policy.io import load_policy
from reliability.test_resume_robotics import assert_same_tensors, training_state, write_tiny_demos
from robotics_reach import reach_envs

REPO = Path(__file__).resolve().parents[2]

torch.set_num_threads(1)


def _hand_policy() -> GaussianChunkPolicy:
    """obs_dim 1, Ta 2, Da 2; mean [[0.5, -0.5], [1, 2]] for every obs, std [[0.5, 1], [2, 1]]."""
    policy = GaussianChunkPolicy(1, 2, 2, hidden_dims=[4], init_std=1.0, min_std=0.1)
    with torch.no_grad():
        for parameter in policy.mean_net.parameters():
            parameter.zero_()
        policy.mean_net.output.bias.copy_(torch.tensor([0.5, -0.5, 1.0, 2.0]))
        policy.log_std.copy_(torch.tensor([[0.5, 1.0], [2.0, 1.0]]).log())
    return policy


def test_log_prob_and_entropy_by_hand():
    policy = _hand_policy()
    obs, actions = torch.zeros(1, 1), torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    half_log_2pi = 0.5 * math.log(2 * math.pi)  # 0.918939
    # step 0: N(1 | 0.5, 0.5) = -0.5 * 1^2 - log 0.5 - 0.918939 = -0.725791; N(0 | -0.5, 1) = -0.125 - 0.918939
    step0 = (-0.5 - math.log(0.5) - half_log_2pi) + (-0.125 - half_log_2pi)  # -1.769730
    assert policy.log_prob(obs, actions, act_steps=1).item() == pytest.approx(step0, abs=1e-6)
    assert step0 == pytest.approx(-1.769730, abs=1e-6)
    # step 1: N(0 | 1, 2) = -0.5 * 0.25 - log 2 - 0.918939; N(0 | 2, 1) = -2 - 0.918939
    step1 = (-0.125 - math.log(2.0) - half_log_2pi) + (-2.0 - half_log_2pi)
    assert policy.log_prob(obs, actions, act_steps=2).item() == pytest.approx(step0 + step1, abs=1e-6)
    # entropy per entry 0.5 * log(2 pi e) + log std = 1.418939 + log std
    per_entry = 0.5 * math.log(2 * math.pi * math.e)
    assert policy.entropy(1).item() == pytest.approx(2 * per_entry + math.log(0.5), abs=1e-6)  # 2.144731
    assert policy.entropy(2).item() == pytest.approx(4 * per_entry + math.log(0.5) + math.log(2.0), abs=1e-6)  # 5.675756


def test_std_floor_and_sampling():
    policy = _hand_policy()
    with torch.no_grad():
        policy.log_std.fill_(math.log(1e-4))
    assert torch.equal(policy.std(), torch.full((2, 2), 0.1))  # min_std
    obs = torch.zeros(3, 1)
    assert torch.equal(policy.sample(obs, deterministic=True).actions, policy.mean(obs))
    sample = policy.sample(obs, noise_clip=3.0, generator=torch.Generator().manual_seed(0)).actions
    assert ((sample - policy.mean(obs)).abs() <= 0.3 + 1e-6).all()  # |eps| <= 3, std 0.1
    with pytest.raises(ValueError, match="min_std <= init_std"):
        GaussianChunkPolicy(1, 1, 1, hidden_dims=[4], init_std=0.1, min_std=0.2)


@pytest.fixture(scope="module")
def gaussian_bc_checkpoint(tmp_path_factory) -> str:
    """Gaussian BC on reach demos that move towards the goal (action sign(goal - pos))."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    obs = torch.cat([torch.rand(256, 1, generator=generator) * 0.6 - 0.3,
                     torch.randint(0, 2, (256, 1), generator=generator) * 1.2 - 0.6], dim=1)
    actions = torch.sign(obs[:, 1:] - obs[:, :1]).unsqueeze(1).expand(256, 2, 1).contiguous()
    module = GaussianBCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, hidden_dims=[32], init_std=0.3,
                              lr=3e-3, task="reach")
    trainer = pl.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path_factory.mktemp("gbc"))
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=64, shuffle=True))
    path = tmp_path_factory.mktemp("ckpt") / "gbc.ckpt"
    trainer.save_checkpoint(path)
    policy, metadata = load_gaussian_policy(path)
    assert metadata["kind"] == "gaussian_bc" and metadata["task"] == "reach"
    assert torch.equal(policy.log_std, torch.full((2, 1), math.log(0.3)))  # MSE BC does not train the std
    return str(path)


def test_two_ppo_iterations(gaussian_bc_checkpoint, tmp_path):
    torch.manual_seed(0)
    module = GaussianPPOModule(gaussian_bc_checkpoint, num_iterations=2, num_envs=4, n_steps=6, batch_size=8,
                               update_epochs=2, n_critic_warmup_itr=1, eval_every=1, eval_episodes=4, gamma=0.99,
                               critic_hidden_dims=[16], clip_coef=0.2, ent_coef=0.01, target_kl=None,
                               env_factory=reach_envs)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    metrics = module.last_metrics
    assert module.iteration == 2
    assert metrics["perf/env_steps_total"] == 2 * 4 * 6 * 2  # iterations x envs x chunk steps x act_steps
    # each minibatch's first ratio is exp(0): the rollout's log-probs are re-scored by the same weights
    assert metrics["policy/ratio_first_minibatch_maxdev"] < 1e-5
    assert all(math.isfinite(metrics[key]) for key in ("losses/policy", "losses/value", "eval/return"))
    # 24 env steps / minibatch 8 = 3 minibatches x 2 epochs, none stopped (target_kl None)
    assert metrics["policy/minibatches"] == 6.0
    # iteration 0 is critic warm-up, iteration 1 trains the mean and the std (entropy bonus moves log_std)
    after = module.policy.state_dict()
    assert not torch.equal(after["log_std"], before["log_std"])
    assert not torch.equal(after["mean_net.output.weight"], before["mean_net.output.weight"])
    path = tmp_path / "ppo.ckpt"
    trainer.save_checkpoint(path)
    reloaded, metadata = load_gaussian_policy(path)
    assert metadata["kind"] == "gaussian_ppo"
    with pytest.raises(ValueError, match="holds a Gaussian policy"):
        load_policy(path)  # the diffusion loader (mmpo rollout, DPPO's bc_checkpoint) names the mix-up
    assert all(torch.equal(value, after[key]) for key, value in reloaded.state_dict().items())


def test_chain_settings_and_diffusion_checkpoints_are_rejected(gaussian_bc_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="denoising-chain settings"):
        GaussianPPOModule(gaussian_bc_checkpoint, ft_steps=5, env_factory=reach_envs)
    with pytest.raises(ValueError, match="clip_coef must be > 0"):
        GaussianPPOModule(gaussian_bc_checkpoint, clip_coef=0.0, env_factory=reach_envs)
    bogus = tmp_path / "diffusion.ckpt"
    torch.save({"state_dict": {}, "robotics": {"kind": "bc"}}, bogus)
    with pytest.raises(ValueError, match="not a Gaussian policy checkpoint"):
        GaussianPPOModule(str(bogus), env_factory=reach_envs)


def _cli_args(config: str, root: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(REPO / "configs" / "robotics" / config), "--trainer.default_root_dir", str(root),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"), *extra]


def test_mmpo_fit_configs_run_and_ppo_resumes_bit_exactly(tmp_path):
    """`mmpo fit` of both configs at a tiny size: Gaussian BC on Lift-shaped demos, then Gaussian PPO on Hopper
    (in-process envs) from a Gaussian BC checkpoint, resumed from its iteration-1 checkpoint to the same end state."""
    from mmpo.cli import main

    demos = write_tiny_demos(tmp_path / "lift.hdf5")
    main(_cli_args("gaussian_bc_lift.yaml", tmp_path / "gbc", "--data.init_args.dataset_path", str(demos),
                   "--data.init_args.batch_size", "8", "--model.init_args.hidden_dims", "[16, 16, 16]",
                   "--trainer.max_epochs", "2"))
    policy, metadata = load_gaussian_policy(tmp_path / "gbc" / "checkpoints" / "last.ckpt")
    assert (policy.obs_dim, policy.action_dim, policy.horizon, metadata["task"]) == (19, 7, 4, "lift")

    torch.manual_seed(0)
    bc = GaussianBCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, hidden_dims=[8], task="hopper")
    bc_checkpoint = tmp_path / "gbc_hopper.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, bc_checkpoint)
    ppo = ["--model.init_args.bc_checkpoint", str(bc_checkpoint), "--model.init_args.task", "hopper",
           "--model.init_args.num_iterations", "3", "--model.init_args.num_envs", "2", "--model.init_args.n_steps", "3",
           "--model.init_args.max_episode_steps", "8", "--model.init_args.batch_size", "3",
           "--model.init_args.update_epochs", "1", "--model.init_args.n_critic_warmup_itr", "1",
           "--model.init_args.eval_every", "2", "--model.init_args.eval_episodes", "2",
           "--model.init_args.critic_hidden_dims", "[8]", "--model.init_args.asynchronous", "false",
           "--trainer.callbacks.init_args.filename", "{step}", "--trainer.callbacks.init_args.every_n_train_steps", "1"]
    main(_cli_args("gaussian_ppo_lift.yaml", tmp_path / "full", *ppo))
    # global_step counts optimizer steps: iteration 0 (critic warm-up) 2 minibatches (6 env steps / 3) x the
    # critic = 2; iterations 1 and 2: 2 minibatches x 2 optimizers = 4 each (10 in all)
    assert torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10
    first = tmp_path / "full" / "checkpoints" / "step=2.ckpt"
    assert torch.load(first, weights_only=True)["dppo_state"]["iteration"] == 1
    main(_cli_args("gaussian_ppo_lift.yaml", tmp_path / "resumed", *ppo, "--ckpt_path", str(first)))
    expected = training_state(tmp_path / "full" / "checkpoints" / "last.ckpt")
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["iteration"] == 3 and expected["dppo_state"]["env_steps"] == 3 * 2 * 3 * 2
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])


def test_gaussian_bc_skips_a_nonfinite_step_and_keeps_the_weights():
    import lightning.pytorch as pl
    import torch

    from robotics.gaussian_ppo import GaussianBCModule

    module = GaussianBCModule(obs_dim=3, action_dim=2, horizon=2, act_steps=1, hidden_dims=[8])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    nan_batch = (torch.zeros(4, 3), torch.full((4, 2, 2), float("nan")))  # NaN actions: a NaN loss
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    from torch.utils.data import DataLoader

    trainer.fit(module, train_dataloaders=DataLoader([nan_batch], batch_size=None))
    assert module.nonfinite.skipped_steps == 1
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_target_kl_stops_the_update_and_the_metrics_say_so(gaussian_bc_checkpoint, tmp_path):
    # the first minibatch re-scores the rollout with the same weights (approx_kl ~0 < 1e-6); one step at lr 1e-2
    # moves the policy past 1e-6, so the second minibatch stops the update: 2 of 2 x 3 minibatches ran
    torch.manual_seed(0)
    module = GaussianPPOModule(gaussian_bc_checkpoint, num_iterations=1, num_envs=4, n_steps=6, batch_size=8,
                               update_epochs=2, n_critic_warmup_itr=0, gamma=0.99, critic_hidden_dims=[16],
                               clip_coef=0.2, actor_lr=1e-2, target_kl=1e-6, env_factory=reach_envs)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    metrics = module.last_metrics
    assert metrics["policy/minibatches"] == 2.0
    assert metrics["policy/approx_kl_last"] > 1e-6
    assert metrics["policy/approx_kl"] == pytest.approx(metrics["policy/approx_kl_last"] / 2, rel=1e-3)
