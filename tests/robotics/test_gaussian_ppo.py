"""Gaussian-policy PPO baseline (mmpo/robotics/gaussian_ppo.py): its log-prob and entropy by hand, BC of the
mean, and a 2-iteration PPO run on the tiny reach task of test_dppo.py; the Gaussian PPO options and BC reuse
of bench/bench_dppo_vs_gaussian.py."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmpo.robotics.gaussian_ppo import GaussianBCModule, GaussianChunkPolicy, GaussianPPOModule, load_gaussian_policy
from mmpo.robotics.policy.io import load_policy
from reliability.test_resume_robotics import assert_same_tensors, training_state, write_tiny_demos
from robotics_reach import reach_envs
from bench_support import load_bench

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


def test_mean_log_prob_reduction_by_hand():
    policy = _hand_policy()
    obs, actions = torch.zeros(1, 1), torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    summed = (-0.5 - math.log(0.5) - half_log_2pi) + (-0.125 - half_log_2pi) \
        + (-0.125 - math.log(2.0) - half_log_2pi) + (-2.0 - half_log_2pi)  # 2 steps x 2 dims: -6.425754
    assert summed == pytest.approx(-6.425754, abs=1e-6)
    assert policy.log_prob(obs, actions, act_steps=2).item() == pytest.approx(summed, abs=1e-6)  # default: sum
    assert policy.log_prob(obs, actions, act_steps=2, reduction="mean").item() == pytest.approx(summed / 4, abs=1e-6)
    assert policy.log_prob(obs, actions, 1, "mean").item() == pytest.approx(
        ((-0.5 - math.log(0.5) - half_log_2pi) + (-0.125 - half_log_2pi)) / 2, abs=1e-6)  # 1 step x 2 dims
    per_entry = 0.5 * math.log(2 * math.pi * math.e)
    assert policy.entropy(2, "mean").item() == pytest.approx(per_entry + (math.log(0.5) + math.log(2.0)) / 4, abs=1e-6)
    # PPO ratio of the 2 x 2 chunk after moving the std of entry (1, 1) from 1 to 2: exp((new - old) / 4) under mean
    old_sum, old_mean = policy.log_prob(obs, actions, 2).item(), policy.log_prob(obs, actions, 2, "mean").item()
    with torch.no_grad():
        policy.log_std[1, 1] = math.log(2.0)
    new_sum, new_mean = policy.log_prob(obs, actions, 2).item(), policy.log_prob(obs, actions, 2, "mean").item()
    # N(0 | 2, 2) - N(0 | 2, 1) = (-0.5 - log 2) - (-2) = 0.806853 (summed log-ratio)
    assert new_sum - old_sum == pytest.approx(1.5 - math.log(2.0), abs=1e-6)
    assert math.exp(new_mean - old_mean) == pytest.approx(math.exp((1.5 - math.log(2.0)) / 4), abs=1e-6)  # 1.223...
    with pytest.raises(ValueError, match=r"log_prob_reduction must be one of \('sum', 'mean'\), got 'avg'"):
        policy.log_prob(obs, actions, 2, "avg")


def test_mean_reduction_ppo_ratio_is_the_summed_log_ratio_over_the_entries(gaussian_bc_checkpoint):
    """GaussianPPOModule(log_prob_reduction="mean"): rollout and update log-probs, ratio and approx_kl all use
    the per-entry mean (act_steps 2 x Da 1 = 2 entries here; the by-hand 2 x 2 = 4 case is the test above)."""
    torch.manual_seed(0)
    common = dict(env={"num_envs": 2, "n_steps": 2}, optim={"minibatch_size": 4}, critic={"hidden_dims": [8]},
                  env_factory=reach_envs)
    module = GaussianPPOModule(gaussian_bc_checkpoint, 1, gaussian={"log_prob_reduction": "mean"}, **common)
    assert module.gaussian.log_prob_reduction == "mean" and module.hparams.gaussian["log_prob_reduction"] == "mean"
    assert GaussianPPOModule(gaussian_bc_checkpoint, 1, **common).gaussian.log_prob_reduction == "sum"
    with pytest.raises(ValueError, match="log_prob_reduction must be one of"):
        GaussianPPOModule(gaussian_bc_checkpoint, 1, gaussian={"log_prob_reduction": "Mean"}, **common)
    entries = module.act_steps * module.policy.action_dim
    obs = torch.rand(5, 2)
    with torch.no_grad():
        chains, _, old = module.act(obs)
        old_sum = module.policy.log_prob(obs, chains, module.act_steps, "sum")
        assert torch.allclose(old.squeeze(1), old_sum / entries, atol=1e-6)
        module.policy.mean_net.output.bias.add_(0.05)  # the "new" policy
        module.policy.log_std.add_(0.1)
        new_sum = module.policy.log_prob(obs, chains, module.act_steps, "sum")
        _, _, ratio, metrics = module.minibatch_loss(obs, chains, torch.zeros(5, dtype=torch.long), old.squeeze(1),
                                                     torch.randn(5), torch.zeros(5))
    assert torch.allclose(ratio, torch.exp((new_sum - old_sum) / entries), atol=1e-6)
    assert not torch.allclose(ratio, torch.exp(new_sum - old_sum), atol=1e-3)  # the sum's ratio differs
    log_ratio = (new_sum - old_sum) / entries  # approx_kl on the mean's log-ratio scale
    assert metrics["policy/approx_kl"].item() == pytest.approx(((log_ratio.exp() - 1) - log_ratio).mean().item(),
                                                               rel=1e-4)

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


@pytest.mark.parametrize("env_groups", [1, 2])
def test_two_ppo_iterations(gaussian_bc_checkpoint, tmp_path, env_groups):
    """Also with pipelined collection (env_groups=2: each group's act draws its own noise)."""
    torch.manual_seed(0)
    module = GaussianPPOModule(gaussian_bc_checkpoint, num_iterations=2,
                               env={"num_envs": 4, "n_steps": 6, "env_groups": env_groups},
                               optim={"minibatch_size": 8, "mu": 2}, critic={"warmup_iterations": 1, "hidden_dims": [16]},
                               evaluation={"every": 1, "episodes": 4}, returns={"gamma": 0.99},
                               gaussian={"clip_coef": 0.2, "ent_coef": 0.01}, loss={"target_kl": None},
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
    with pytest.raises(ValueError, match=r"\['evaluation.sampler'\] are denoising-chain settings of DPPO"):
        GaussianPPOModule(gaussian_bc_checkpoint, evaluation={"sampler": "ddim"}, env_factory=reach_envs)
    with pytest.raises(TypeError, match="chain"):
        GaussianPPOModule(gaussian_bc_checkpoint, chain={"ft_steps": 5}, env_factory=reach_envs)
    with pytest.raises(ValueError, match="^clip_coef must be > 0, got 0.0$"):
        GaussianPPOModule(gaussian_bc_checkpoint, gaussian={"clip_coef": 0.0}, env_factory=reach_envs)
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
    ppo = ["--model.init_args.bc_checkpoint", str(bc_checkpoint), "--model.init_args.env.task", "hopper",
           "--model.init_args.num_iterations", "3", "--model.init_args.env.num_envs", "2",
           "--model.init_args.env.n_steps", "3", "--model.init_args.env.max_episode_steps", "8",
           "--model.init_args.optim.minibatch_size", "3", "--model.init_args.optim.mu", "1",
           "--model.init_args.critic.warmup_iterations", "1",
           "--model.init_args.evaluation.every", "2", "--model.init_args.evaluation.episodes", "2",
           "--model.init_args.critic.hidden_dims", "[8]", "--model.init_args.env.asynchronous", "false",
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

    from mmpo.robotics.gaussian_ppo import GaussianBCModule

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
    module = GaussianPPOModule(gaussian_bc_checkpoint, num_iterations=1, env={"num_envs": 4, "n_steps": 6},
                               optim={"minibatch_size": 8, "mu": 2, "lr": 1e-2},
                               critic={"warmup_iterations": 0, "hidden_dims": [16]}, returns={"gamma": 0.99},
                               gaussian={"clip_coef": 0.2}, loss={"target_kl": 1e-6}, env_factory=reach_envs)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module)
    metrics = module.last_metrics
    assert metrics["policy/minibatches"] == 2.0
    assert metrics["policy/approx_kl_last"] > 1e-6
    assert metrics["policy/approx_kl"] == pytest.approx(metrics["policy/approx_kl_last"] / 2, rel=1e-3)


# ---------------------------------------------------------------- bench/bench_dppo_vs_gaussian.py's Gaussian side
# Run E's settings (bench/RESULTS.md; runs/i19/launch.sh's COMMON without the paths)
RUN_E = ["--num-demos", "100", "--noise", "0.5", "--bc-epochs", "100", "--hidden", "512", "--num-envs", "4",
         "--n-steps", "38", "--max-episode-steps", "150", "--eval-episodes", "100", "--eval-sampler", "ddim",
         "--batch-size", "600", "--dppo-env-steps", "100000", "--dppo-max-minutes", "30", "--curve-eval-every", "25",
         "--curve-eval-episodes", "12", "--sync-envs"]


def _bench():
    return load_bench("bench_dppo_vs_gaussian")


def _update(module: GaussianPPOModule) -> tuple:
    actor, _ = module.configure_optimizers()
    return (module.optim.lr, actor.param_groups[0]["lr"], module.loss.target_kl, module.optim.mu,
            module.chain.clip_base, module.chain.clip_final, module.optim.minibatch_size, module.hparams.num_iterations)


def test_bench_gaussian_defaults_build_run_e_module(gaussian_bc_checkpoint):
    bench = _bench()
    args = bench.parse_args(RUN_E)
    module = bench.gaussian_module(gaussian_bc_checkpoint, args, 0)
    # Run E's construction (the bench's call before the --gaussian-* update options), written out
    before = GaussianPPOModule(
        gaussian_bc_checkpoint, bench.rl_iterations(args), gaussian={"clip_coef": args.gaussian_clip},
        env={"num_envs": args.num_envs, "n_steps": args.n_steps, "max_episode_steps": args.max_episode_steps,
             "asynchronous": not args.sync_envs},
        optim={"minibatch_size": args.gaussian_batch_size, "mu": args.update_epochs, "lr": args.actor_lr},
        critic={"warmup_iterations": args.critic_warmup}, seed=0)
    assert dict(module.hparams) == dict(before.hparams)
    assert sorted(module.hparams) == ["bc_checkpoint", "critic", "env", "evaluation", "gaussian", "loss",
                                      "max_consecutive_skips", "num_iterations", "optim", "returns", "seed"]
    # lr 1e-4, target_kl 1.0, 10 epochs, clip 0.01, 600 / K' 10 = 60 env steps, ceil(100000 / (4 x 38 x 4)) = 165
    assert _update(module) == (1e-4, 1e-4, 1.0, 10, 0.01, 0.01, 60, 165)
    expected = {"actor_lr": 1e-4, "target_kl": 1.0, "update_epochs": 10, "batch_size": 60, "clip_base": 0.01,
                "clip_final": 0.01, "log_prob_reduction": "sum"}
    assert module.gaussian.log_prob_reduction == "sum"
    assert bench.rl_settings("gaussian", vars(args)) == expected
    # a record written before the options existed (Run E's) reports the same settings
    old = {k: v for k, v in vars(args).items()
           if k not in ("gaussian_actor_lr", "gaussian_target_kl", "gaussian_update_epochs", "reuse_bc_from",
                        "gaussian_log_prob_reduction")}
    assert bench.rl_settings("gaussian", old) == expected


def test_bench_gaussian_options_reach_the_module_and_leave_dppo_alone(gaussian_bc_checkpoint):
    bench = _bench()
    args = bench.parse_args(RUN_E + ["--gaussian-actor-lr", "1e-5", "--gaussian-target-kl", "0.02",
                                     "--gaussian-update-epochs", "5", "--gaussian-clip", "0.02"])
    module = bench.gaussian_module(gaussian_bc_checkpoint, args, 3)
    assert _update(module) == (1e-5, 1e-5, 0.02, 5, 0.02, 0.02, 60, 165)
    assert module.hparams.seed == 3 and module.critic_config.lr == 1e-3  # the critic keeps its lr
    assert bench.rl_settings("gaussian", vars(args)) == {"actor_lr": 1e-5, "target_kl": 0.02, "update_epochs": 5,
                                                         "batch_size": 60, "clip_base": 0.02, "clip_final": 0.02,
                                                         "log_prob_reduction": "sum"}
    dppo = {"actor_lr": 1e-4, "target_kl": 1.0, "update_epochs": 10, "batch_size": 600, "clip_base": 0.001,
            "clip_final": 0.01}
    assert bench.rl_settings("dppo", vars(args)) == bench.rl_settings("dppo", vars(bench.parse_args(RUN_E))) == dppo


def test_bench_gaussian_log_prob_reduction_reaches_the_module(gaussian_bc_checkpoint):
    bench = _bench()
    args = bench.parse_args(RUN_E + ["--gaussian-log-prob-reduction", "mean"])
    module = bench.gaussian_module(gaussian_bc_checkpoint, args, 0)
    assert module.gaussian.log_prob_reduction == "mean"
    assert _update(module) == (1e-4, 1e-4, 1.0, 10, 0.01, 0.01, 60, 165)  # nothing else moves
    assert bench.rl_settings("gaussian", vars(args))["log_prob_reduction"] == "mean"
    assert "log_prob_reduction" not in bench.rl_settings("dppo", vars(args))
    with pytest.raises(SystemExit):
        bench.parse_args(RUN_E + ["--gaussian-log-prob-reduction", "avg"])
    # the aggregate's settings line names a non-default reduction only
    result = {"methods": {"gaussian": {"seeds": [0, 1], "sources": [None, None], "bc_reused_from": [None, None],
                                       "rl_settings": [bench.rl_settings("gaussian", vars(args)),
                                                       bench.rl_settings("gaussian", vars(bench.parse_args(RUN_E)))]}}}
    lines = bench.settings_lines(result)
    assert len(lines) == 2 and "log-probs mean over the chunk" in lines[0] and "log-probs" not in lines[1]


def _source_run(tmp_path: Path, checkpoint: str, demos: Path, **bc_args) -> Path:
    """An out-dir of the bench that ran Gaussian seed 0: record + bc.ckpt (normaliser: ``demos``'s) + sidecar."""
    from mmpo.training.checkpoint import file_sha256

    source = tmp_path / "source"
    (source / "seed0" / "gaussian").mkdir(parents=True)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["robotics"]["normalizer_path"] = f"{demos}.stats.json"
    ckpt = source / "seed0" / "gaussian" / "bc.ckpt"
    torch.save(state, ckpt)
    ckpt.with_name("bc.ckpt.sha256").write_text(f"{file_sha256(ckpt)}  bc.ckpt\n")
    (source / "seed0_gaussian.json").write_text(json.dumps({"seed": 0, "method": "gaussian", "bc_seconds": 67.0,
                                                            "args": bc_args}))
    return source


def test_bench_reuse_bc_copies_a_checked_checkpoint(gaussian_bc_checkpoint, tmp_path):
    bench = _bench()
    demos, other = tmp_path / "demos.hdf5", tmp_path / "other.hdf5"
    for path in (demos, other):
        Path(f"{path}.stats.json").write_text("{}")
    bc = dict(num_demos=100, noise=0.5, bc_epochs=100, hidden=32, max_episode_steps=150, gaussian_bc_lr=1e-3)
    source = _source_run(tmp_path, gaussian_bc_checkpoint, demos, **bc)
    args = argparse.Namespace(reuse_bc_from=str(source), **bc)
    seed_dir = tmp_path / "new" / "seed0" / "gaussian"
    seed_dir.mkdir(parents=True)
    copy, info = bench.reuse_bc(0, "gaussian", args, demos, seed_dir)
    original = source / "seed0" / "gaussian" / "bc.ckpt"
    assert copy == seed_dir / "bc.ckpt" and copy.read_bytes() == original.read_bytes()
    assert info == {"from": str(original), "sha256": original.with_name("bc.ckpt.sha256").read_text().split()[0],
                    "source_bc_seconds": 67.0}
    assert copy.with_name("bc.ckpt.sha256").read_text() == original.with_name("bc.ckpt.sha256").read_text()
    with pytest.raises(ValueError, match=r"other settings .*'bc_epochs': \(100, 200\)"):
        bench.reuse_bc(0, "gaussian", argparse.Namespace(**{**vars(args), "bc_epochs": 200}), demos, seed_dir)
    with pytest.raises(ValueError, match="not this run's"):
        bench.reuse_bc(0, "gaussian", args, other, seed_dir)
    with pytest.raises(FileNotFoundError, match="seed1_gaussian.json"):
        bench.reuse_bc(1, "gaussian", args, demos, seed_dir)
    with open(original, "ab") as handle:
        handle.write(b"x")
    with pytest.raises(ValueError, match="sha256 check"):
        bench.reuse_bc(0, "gaussian", args, demos, seed_dir)
