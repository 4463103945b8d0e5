"""bench/bench_dppo_vs_gaussian.py --continue-from: a finished RL fit run further equals the longer fit run at
once (every tensor of the final checkpoint), and a source run with other options is refused."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mmpo.training.checkpoint import atomic_torch_save
from reliability.test_resume_robotics import (  # noqa: F401  (pendulum_bc_checkpoint is a fixture)
    _pendulum_envs,
    _SaveAfterIterations,
    assert_same_tensors,
    pendulum_bc_checkpoint,
    training_state,
)
from mmpo.robotics.dppo import DPPOModule
from bench_support import load_bench


def _bench():
    return load_bench("bench_dppo_vs_gaussian")


SETTINGS = dict(env={"num_envs": 3, "n_steps": 6}, chain={"ft_steps": 3}, optim={"minibatch_size": 12, "mu": 2, "lr": 1e-3},
                critic={"warmup_iterations": 1, "hidden_dims": [16, 16]}, evaluation={"every": 2, "episodes": 3},
                returns={"gamma": 0.99}, loss={"target_kl": None}, seed=5)
# The same settings as DPPOModule's flat init arguments before the config groups saved them in a checkpoint.
FLAT_SETTINGS = dict(num_envs=3, n_steps=6, ft_steps=3, batch_size=12, update_epochs=2, actor_lr=1e-3,
                     n_critic_warmup_itr=1, critic_hidden_dims=[16, 16], eval_every=2, eval_episodes=3, gamma=0.99,
                     gae_lambda=0.95, target_kl=None, seed=5, loss="ppo", loss_settings=None, max_grad_norm=None,
                     critic_lr=1e-3, weight_decay=0.0, vf_coef=0.5, eval_sampler=None, eval_ddpm_std_floor=None,
                     task=None, act_steps=None, max_episode_steps=None, normalizer_path=None, asynchronous=True,
                     max_env_worker_restarts=3, env_groups=1, prefetch_reset=False, skip_final_autoreset=True,
                     reset_at_iteration=True, reward_scale_running=True, reward_scale_const=1.0,
                     reward_scale_gamma=0.99, clip_base=0.001, clip_final=0.01, clip_rate=3.0, gamma_denoise=0.99,
                     min_sampling_std=0.1, noise_clip=3.0, min_logprob_std=0.1, logprob_min=-5.0, logprob_max=2.0,
                     rollout_ddim_steps=None, max_consecutive_skips=10)


def _with_flat_hyperparameters(source: Path, target: Path) -> Path:
    """``source`` as a checkpoint saved before the config groups: its hyperparameters in the old flat names."""
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["hyper_parameters"] = {"bc_checkpoint": checkpoint["hyper_parameters"]["bc_checkpoint"],
                                      "num_iterations": checkpoint["hyper_parameters"]["num_iterations"],
                                      **FLAT_SETTINGS}
    atomic_torch_save(checkpoint, target)
    return target


def _fit(bc_checkpoint: Path, root: Path, num_iterations: int, ckpt_path: Path | None = None,
         **trainer_settings) -> DPPOModule:
    """test_resume_robotics' tiny Pendulum DPPO fit, ``num_iterations`` long; saves ``end.ckpt`` when done (as the
    bench's fit_rl does) and ``iteration=4.ckpt`` on the way."""
    torch.manual_seed(0)
    module = DPPOModule(str(bc_checkpoint), num_iterations=num_iterations, **SETTINGS, env_factory=_pendulum_envs)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[_SaveAfterIterations(root, {4})], default_root_dir=root,
                         **trainer_settings)
    trainer.fit(module, ckpt_path=ckpt_path)
    trainer.save_checkpoint(root / "end.ckpt")
    return module


def test_a_finished_fit_continued_equals_the_longer_fit(pendulum_bc_checkpoint, tmp_path):
    bench = _bench()
    full = _fit(pendulum_bc_checkpoint, tmp_path / "full", 4)
    short = _fit(pendulum_bc_checkpoint, tmp_path / "short", 3)
    assert short.iteration == 3
    # without the rewrite Lightning sees a finished epoch and runs nothing
    stopped = _fit(pendulum_bc_checkpoint, tmp_path / "stopped", 4, tmp_path / "short" / "end.ckpt")
    assert stopped.iteration == 3
    assert bench.continuation_checkpoint(tmp_path / "short" / "end.ckpt", tmp_path / "continue.ckpt") == 3
    continued = _fit(pendulum_bc_checkpoint, tmp_path / "continued", 4, tmp_path / "continue.ckpt")
    assert continued.iteration == 4
    expected = training_state(tmp_path / "full" / "iteration=4.ckpt")
    actual = training_state(tmp_path / "continued" / "iteration=4.ckpt")
    # weights, both AdamW states, the generator and RNG streams, the reward scaler, env steps
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"]) + 10
    assert actual["dppo_state"]["env_steps"] == 4 * 3 * 6 * 2
    for key, value in full.last_metrics.items():
        if not key.startswith("perf/env_steps_per_s"):
            assert value == continued.last_metrics[key] or (value != value and continued.last_metrics[key] != continued.last_metrics[key]), key
    # a checkpoint saved before the config groups (flat hyperparameters) continues to the same end state
    old = _with_flat_hyperparameters(tmp_path / "short" / "end.ckpt", tmp_path / "old_flat.ckpt")
    assert bench.continuation_checkpoint(old, tmp_path / "continue_old.ckpt") == 3
    _fit(pendulum_bc_checkpoint, tmp_path / "continued_old", 4, tmp_path / "continue_old.ckpt")
    assert assert_same_tensors(expected, training_state(tmp_path / "continued_old" / "iteration=4.ckpt")) > len(
        expected["state_dict"]) + 10


def test_a_checkpoint_with_flat_hyperparameters_loads_into_the_groups(pendulum_bc_checkpoint, tmp_path):
    """``load_from_checkpoint`` of a checkpoint saved before the config groups: every old flat value lands in its
    group's field, and the module is the one the grouped settings build."""
    _fit(pendulum_bc_checkpoint, tmp_path / "run", 1)
    old = _with_flat_hyperparameters(tmp_path / "run" / "end.ckpt", tmp_path / "old_flat.ckpt")
    module = DPPOModule.load_from_checkpoint(old, env_factory=_pendulum_envs)
    assert (module.env.num_envs, module.env.n_steps, module.env.max_worker_restarts) == (3, 6, 3)
    assert (module.optim.lr, module.optim.mu, module.optim.minibatch_size, module.optim.max_grad_norm) == (1e-3, 2, 12, 0.0)
    assert (module.critic_config.warmup_iterations, module.critic_config.hidden_dims) == (1, [16, 16])
    assert (module.evaluation.every, module.evaluation.episodes, module.loss.target_kl) == (2, 3, None)
    assert (module.chain.ft_steps, module.returns.gamma, module.returns.lam, module.hparams.seed) == (3, 0.99, 0.95, 5)
    saved = torch.load(tmp_path / "run" / "end.ckpt", weights_only=True)
    for group in DPPOModule.config_groups:  # every group equals the one the grouped settings saved
        assert module.hparams[group] == saved["hyper_parameters"][group], group
    for key, value in saved["state_dict"].items():
        assert torch.equal(module.state_dict()[key], value), key


def test_only_the_end_of_a_finished_fit_is_continued(pendulum_bc_checkpoint, tmp_path):
    bench = _bench()
    _fit(pendulum_bc_checkpoint, tmp_path / "full", 4)
    checkpoint = torch.load(tmp_path / "full" / "end.ckpt", weights_only=False)
    checkpoint["dppo_state"]["iteration"] = 2  # loop state and DPPO iteration disagree
    atomic_torch_save(checkpoint, tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match="not the end of a finished one-epoch RL fit"):
        bench.continuation_checkpoint(tmp_path / "odd.ckpt", tmp_path / "continue.ckpt")
    # a mid-run checkpoint (epoch not finished) is a plain resume, not a continuation
    with pytest.raises(ValueError, match="not the end of a finished one-epoch RL fit"):
        bench.continuation_checkpoint(tmp_path / "full" / "iteration=4.ckpt", tmp_path / "continue.ckpt")


RUN = ["--num-envs", "4", "--n-steps", "38", "--max-episode-steps", "150", "--batch-size", "600",
       "--bc-epochs", "100", "--hidden", "512", "--sync-envs"]


def _source(tmp_path: Path, bench, extra: list[str], status: str = "done", iterations: int = 165) -> Path:
    """A source out-dir holding a (seed 0, dppo) record made with RUN + ``extra`` and an RL checkpoint file."""
    source = tmp_path / "source"
    (source / "seed0" / "dppo").mkdir(parents=True)
    args = bench.parse_args(RUN + ["--dppo-env-steps", "99000", *extra])
    record = {"seed": 0, "method": "dppo", "status": status, "args": vars(args),
              "rl_settings": bench.rl_settings("dppo", vars(args)), "rl_iterations": iterations, "curve": []}
    (source / "seed0_dppo.json").write_text(json.dumps(record))
    atomic_torch_save({"x": torch.zeros(1)}, source / "seed0" / "dppo" / "rl.ckpt")
    return source


def test_continue_from_checks_the_source(tmp_path):
    bench = _bench()
    source = _source(tmp_path, bench, [])
    args = bench.parse_args(RUN + ["--dppo-env-steps", "300000", "--continue-from", str(source), "--out-dir", "x"])
    assert args.reuse_bc_from == str(source)  # BC comes from the source run
    assert bench.rl_iterations(args) == 494  # ceil(300000 / (4 x 38 x 4))
    ckpt, record = bench.continuation_source(0, "dppo", args)
    assert ckpt == source / "seed0" / "dppo" / "rl.ckpt" and record["rl_iterations"] == 165
    with pytest.raises(ValueError, match="actor_lr"):
        bench.continuation_source(0, "dppo", bench.parse_args(
            RUN + ["--dppo-env-steps", "300000", "--continue-from", str(source), "--actor-lr", "1e-5"]))
    with pytest.raises(ValueError, match="not more than the 165"):
        bench.continuation_source(0, "dppo", bench.parse_args(
            RUN + ["--dppo-env-steps", "99000", "--continue-from", str(source)]))
    with pytest.raises(FileNotFoundError):
        bench.continuation_source(1, "dppo", args)
    (source / "seed0" / "dppo" / "rl.ckpt.sha256").write_text("0" * 64 + "\n")
    with pytest.raises(ValueError, match="sha256"):
        bench.continuation_source(0, "dppo", args)
    with pytest.raises(SystemExit):
        bench.parse_args(RUN + ["--continue-from", str(source), "--reuse-bc-from", "elsewhere"])
    with pytest.raises(SystemExit):  # the source's records and checkpoints must not be overwritten
        bench.parse_args(RUN + ["--continue-from", str(source), "--out-dir", str(source)])


def test_the_demo_file_is_compared_as_the_file_each_run_read(tmp_path):
    """A source that wrote its demos into its own out-dir (no --demos) is continued by naming that file; another
    file, or the continuation's own default file, is refused."""
    bench = _bench()
    source = _source(tmp_path, bench, [])
    record_path = source / "seed0_dppo.json"
    record = json.loads(record_path.read_text())
    record["demos"] = str(source / "lift_demos_n100_noise0.5.hdf5")  # what run_task records: the file it read
    record_path.write_text(json.dumps(record))
    longer = RUN + ["--dppo-env-steps", "300000", "--continue-from", str(source), "--out-dir", str(tmp_path / "cont")]
    ckpt, _ = bench.continuation_source(0, "dppo", bench.parse_args(longer + ["--demos", record["demos"]]))
    assert ckpt == source / "seed0" / "dppo" / "rl.ckpt"
    with pytest.raises(ValueError, match="demos"):
        bench.continuation_source(0, "dppo", bench.parse_args(longer + ["--demos", str(tmp_path / "other.hdf5")]))
    with pytest.raises(ValueError, match="demos"):  # <cont>/lift_demos_n100_noise0.5.hdf5 is another file
        bench.continuation_source(0, "dppo", bench.parse_args(longer))


def test_an_unfinished_source_is_refused(tmp_path):
    bench = _bench()
    source = _source(tmp_path, bench, [], status="rl")
    args = bench.parse_args(RUN + ["--dppo-env-steps", "300000", "--continue-from", str(source)])
    with pytest.raises(ValueError, match="did not finish"):
        bench.continuation_source(0, "dppo", args)


def test_aggregate_reports_the_continued_from_evaluation():
    """A --continue-from record carries its source's final evaluation (mid): BC 1/4 -> mid 2/4 -> after 4/4 on
    seed 0, 0/4 -> 2/4 -> 2/4 on seed 1 (same episode keys)."""
    bench = _bench()

    def episodes(successes):
        return [{"env": k % 2, "ordinal": k // 2, "success": v} for k, v in enumerate(successes)]

    def record(seed, before, mid, after):
        return {"seed": seed, "method": "dppo", "status": "done", "env_steps": 3000.0, "rl_iterations": 6,
                "rl_seconds": 30.0, "bc_seconds": 1.0, "rollout_env_steps_per_s": 100.0, "faults": 0.0, "curve": [],
                "before_episodes": episodes(before), "after_episodes": episodes(after),
                "continued_from": {"env_steps": 1000.0, "after_episodes": episodes(mid)}}

    records = [record(0, [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]), record(1, [0, 0, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0])]
    result = bench.aggregate(records, n_boot=200)
    dppo = result["methods"]["dppo"]
    assert dppo["gain"]["per_seed"] == [0.75, 0.5]
    continued = dppo["continued"]
    assert continued["mid"] == [0.5, 0.5] and continued["mid_env_steps"] == [1000.0, 1000.0]
    assert continued["gain_to_mid"]["per_seed"] == [0.25, 0.5]
    assert continued["after_minus_mid"]["per_seed"] == [0.5, 0.0]
    assert continued["after_minus_mid"]["estimate"] == 0.25
    text = bench.markdown(result)
    assert "added by the extra budget (mid -> after) | 0, 1 | | mid per seed 0.50 / 0.50 at 1,000 / 1,000" in text
    # one seed: its seed-level t interval is undefined, shown as such (not "[+nan, +nan]")
    one_seed = bench.markdown(bench.aggregate([records[0]], n_boot=50))
    assert "| 0 | 4 | 0.25 | 1.00 | 0.250 -> 1.000 | **+0.750** |" in one_seed
    assert "n/a (1 seed)" in one_seed and "nan" not in one_seed
    # a record without a source has no mid: nothing reported
    plain = {k: v for k, v in records[0].items() if k != "continued_from"}
    assert "continued" not in bench.aggregate([plain], n_boot=50)["methods"]["dppo"]


def test_plot_draws_continued_records(tmp_path):
    bench = _bench()
    curve = [{"perf/env_steps_total": 600.0 * (i + 1), "charts/success_rate": 0.5} for i in range(5)]
    base = {"status": "done", "env_steps": 3000.0, "curve": curve, "before": {"success_rate": 0.2, "episodes": 4},
            "after": {"success_rate": 0.6}, "continued_from": {"env_steps": 1200.0, "after": {"success_rate": 0.4}}}
    bench.plot([{**base, "seed": 0, "method": "dppo"}, {**base, "seed": 0, "method": "gaussian"}], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_continuation_gets_its_own_time_cap(pendulum_bc_checkpoint, tmp_path):
    """A run stopped by --dppo-max-minutes (Lightning's Timer, whose elapsed time is in the checkpoint) can be
    continued under a new cap: the source's elapsed time is dropped from the continuation checkpoint."""
    bench = _bench()
    _fit(pendulum_bc_checkpoint, tmp_path / "short", 3)
    source = torch.load(tmp_path / "short" / "end.ckpt", weights_only=False)
    source.setdefault("callbacks", {})["Timer"] = {"time_elapsed": {"train": 1e6, "sanity_check": 0, "validate": 0,
                                                                    "test": 0, "predict": 0}}
    torch.save(source, tmp_path / "capped.ckpt")
    assert bench.continuation_checkpoint(tmp_path / "capped.ckpt", tmp_path / "continue.ckpt") == 3
    assert "Timer" not in torch.load(tmp_path / "continue.ckpt", weights_only=False)["callbacks"]
    continued = _fit(pendulum_bc_checkpoint, tmp_path / "continued", 4, tmp_path / "continue.ckpt",
                     max_time={"seconds": 600})
    assert continued.iteration == 4
