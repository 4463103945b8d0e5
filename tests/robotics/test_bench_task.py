"""bench/bench_dppo_vs_gaussian.py --task {lift,can}: lift's defaults are the ones every earlier run had, can takes
the Can dims and defaults, and a run never continues, reuses or aggregates another task's records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mmpo.training.checkpoint import atomic_torch_save
from reliability.test_resume_robotics import write_tiny_demos
from bench_support import load_bench


# every option of `python bench/bench_dppo_vs_gaussian.py` with no arguments, as before --task (plus task: lift)
LIFT_DEFAULTS = {
    "task": "lift", "out_dir": "runs/bench_dppo_vs_gaussian", "seeds": [0, 1, 2], "num_demos": 100, "noise": 0.5,
    "bc_epochs": 100, "bc_lr": 1e-3, "hidden": 512, "denoising_steps": 20, "ft_steps": 10, "dppo_env_steps": 20_000,
    "num_envs": 4, "n_steps": 38, "max_episode_steps": 150, "batch_size": 600, "update_epochs": 10, "actor_lr": 1e-4,
    "clip_base": 0.001, "clip_final": 0.01, "critic_warmup": 2, "eval_episodes": 100, "stochastic_eval_episodes": 0,
    "eval_sampler": "ddim", "throughput_steps": 400, "device": "cpu", "sync_envs": False, "dppo_max_minutes": None,
    "demos": None, "demos_only": False, "methods": ["dppo", "gaussian"], "gaussian_clip": 0.01,
    "gaussian_batch_size": 60, "gaussian_bc_lr": 1e-3, "gaussian_actor_lr": None, "gaussian_target_kl": None,
    "gaussian_update_epochs": None, "gaussian_log_prob_reduction": "sum", "reuse_bc_from": None,
    "continue_from": None, "curve_eval_every": 0, "curve_eval_episodes": 12, "aggregate": False,
    "aggregate_dirs": None, "aggregate_seeds": None, "plot": None, "n_boot": 10_000,
}


def _bench():
    return load_bench("bench_dppo_vs_gaussian")


def test_lift_defaults_are_unchanged():
    bench = _bench()
    args = bench.parse_args([])
    assert vars(args) == LIFT_DEFAULTS
    assert bench.parse_args(["--task", "lift"]) == args
    assert bench.default_demos(args, Path("out")) == Path("out/lift_demos_n100_noise0.5.hdf5")
    spec = bench.task_spec(args)
    assert (spec.sim_name, spec.obs_dim, spec.action_dim) == ("Lift", 19, 7)
    # bench_dppo_lift's own defaults (its parser is the shared one, mmpo.robotics.bench.build_parser)
    lift = load_bench("bench_dppo_lift").parse_args([])
    assert (lift.task, lift.noise, lift.max_episode_steps, lift.n_steps, lift.num_envs, lift.batch_size,
            lift.eval_episodes, lift.out_dir) == ("lift", 0.5, 150, 38, 8, 1000, 50, "runs/bench_dppo_lift")


def test_can_takes_its_dims_and_defaults():
    bench = _bench()
    args = bench.parse_args(["--task", "can"])
    # noise 0.3 (our Can choice), 300-step episodes (the paper's Can config), one episode per rollout: 300 / 4
    assert vars(args) == {**LIFT_DEFAULTS, "task": "can", "noise": 0.3, "max_episode_steps": 300, "n_steps": 75}
    assert bench.default_demos(args, Path("out")) == Path("out/can_demos_n100_noise0.3.hdf5")
    spec = bench.task_spec(args)
    assert (spec.sim_name, spec.obs_dim, spec.action_dim) == ("PickPlaceCan", 23, 7)
    # an option the user sets keeps its value
    mine = bench.parse_args(["--task", "can", "--noise", "0.5", "--max-episode-steps", "150"])
    assert (mine.noise, mine.max_episode_steps, mine.n_steps) == (0.5, 150, 38)
    with pytest.raises(SystemExit):
        bench.parse_args(["--task", "hopper"])


@pytest.mark.parametrize("task, obs_dim, max_episode_steps", [("lift", 19, 150), ("can", 23, 300)])
def test_the_task_reaches_both_bc_modules_and_the_eval_envs(task, obs_dim, max_episode_steps, monkeypatch):
    import mmpo.robotics.envs

    bench = _bench()
    args = bench.parse_args(["--task", task, "--hidden", "8"])
    fit = lambda module, args, demos, seed_dir: module  # noqa: E731  (the module fit_bc would train)
    monkeypatch.setitem(bench.train_diffusion_bc.__globals__, "fit_bc", fit)
    monkeypatch.setattr(bench, "fit_bc", fit)
    for module in (bench.train_diffusion_bc(0, args, Path("d"), Path("s")),
                   bench.train_gaussian_bc(0, args, Path("d"), Path("s"))):
        hp = module.hparams
        assert (hp.obs_dim, hp.action_dim, hp.task, hp.max_episode_steps) == (obs_dim, 7, task, max_episode_steps)

    def make_vector_env(name, num_envs, **kwargs):
        raise RuntimeError(f"envs {name} {num_envs} {kwargs['max_episode_steps']}")

    monkeypatch.setattr(mmpo.robotics.envs, "make_vector_env", make_vector_env)
    with pytest.raises(RuntimeError, match=f"envs {task} 4 {max_episode_steps}"):
        bench.evaluate(None, args, 0, "stats.json")


def test_a_demo_file_of_another_task_is_refused(tmp_path):
    bench = _bench()
    demos = write_tiny_demos(tmp_path / "demos.hdf5")  # env_name Lift
    bench.check_demos(demos, bench.parse_args([]))
    with pytest.raises(ValueError, match="holds Lift demos, not PickPlaceCan ones"):
        bench.check_demos(demos, bench.parse_args(["--task", "can"]))


COMMON = ["--noise", "0.3", "--max-episode-steps", "300", "--num-envs", "1", "--sync-envs"]


def _source(tmp_path: Path, bench, method: str, task: str | None) -> Path:
    """An out-dir with a finished (seed 0, ``method``) record of COMMON on ``task`` (None: a record from before
    --task, without it) and checkpoint files (sha256 sidecars) where the checks look for them."""
    source = tmp_path / f"source_{task}"
    args = vars(bench.parse_args(COMMON + ["--task", task or "lift", "--dppo-env-steps", "1200"]))
    if task is None:
        del args["task"]
    record = {"seed": 0, "method": method, "status": "done", "args": args, "rl_iterations": 1, "bc_seconds": 1.0,
              "rl_settings": bench.rl_settings(method, args), "curve": [], **({"task": task} if task else {})}
    (source / "seed0" / method).mkdir(parents=True)
    (source / f"seed0_{method}.json").write_text(json.dumps(record))
    for name in ("bc.ckpt", "rl.ckpt"):
        atomic_torch_save({"x": torch.zeros(1)}, source / "seed0" / method / name)
    return source


def test_a_can_run_is_never_continued_by_lift_nor_lift_by_can(tmp_path):
    bench = _bench()
    can = _source(tmp_path, bench, "dppo", "can")
    longer = ["--dppo-env-steps", "2400", "--continue-from"]
    ckpt, record = bench.continuation_source(0, "dppo", bench.parse_args(COMMON + ["--task", "can"] + longer + [str(can)]))
    assert ckpt == can / "seed0" / "dppo" / "rl.ckpt" and record["task"] == "can"
    with pytest.raises(ValueError, match=r"'task': \('can', 'lift'\)"):
        bench.continuation_source(0, "dppo", bench.parse_args(COMMON + longer + [str(can)]))
    old_lift = _source(tmp_path, bench, "dppo", None)  # a record from before --task: lift
    bench.continuation_source(0, "dppo", bench.parse_args(COMMON + longer + [str(old_lift)]))
    with pytest.raises(ValueError, match=r"'task': \('lift', 'can'\)"):
        bench.continuation_source(0, "dppo", bench.parse_args(COMMON + ["--task", "can"] + longer + [str(old_lift)]))


@pytest.mark.parametrize("method", ["dppo", "gaussian"])
def test_a_can_bc_is_never_reused_by_lift(method, tmp_path):
    bench = _bench()
    can = _source(tmp_path, bench, method, "can")
    seed_dir = tmp_path / "new"
    seed_dir.mkdir()
    with pytest.raises(ValueError, match=r"other settings .*'task': \('can', 'lift'\)"):
        bench.reuse_bc(0, method, bench.parse_args(COMMON + ["--reuse-bc-from", str(can)]), Path("d.hdf5"), seed_dir)
    old_lift = _source(tmp_path, bench, method, None)
    with pytest.raises(ValueError, match=r"other settings .*'task': \('lift', 'can'\)"):
        bench.reuse_bc(0, method, bench.parse_args(COMMON + ["--task", "can", "--reuse-bc-from", str(old_lift)]),
                       Path("d.hdf5"), seed_dir)


def _record(seed: int, method: str, **extra) -> dict:
    """A finished record: 0/2 -> 1/2 success."""
    return {"seed": seed, "method": method, "status": "done", "env_steps": 300.0, "rl_iterations": 1,
            "rl_seconds": 10.0, "bc_seconds": 1.0, "rollout_env_steps_per_s": 30.0, "faults": 0.0, "curve": [],
            "before_episodes": [{"env": 0, "ordinal": k, "success": 0} for k in range(2)],
            "after_episodes": [{"env": 0, "ordinal": k, "success": k} for k in range(2)], **extra}


def test_aggregate_refuses_mixed_tasks(tmp_path, monkeypatch):
    bench = _bench()
    # the task stored at the top of the record, or only in its args
    can_dppo = _record(0, "dppo", task="can")
    can_gauss = _record(0, "gaussian", args=vars(bench.parse_args(["--task", "can"])))
    assert bench.records_task([can_dppo, can_gauss]) == "can"
    assert bench.records_task([_record(0, "dppo")]) == "lift"  # a record from before --task
    assert bench.aggregate([can_dppo, can_gauss], n_boot=20)["task"] == "can"
    with pytest.raises(ValueError, match="more than one task: can: seed 0 dppo; lift: seed 0 gaussian"):
        bench.aggregate([can_dppo, _record(0, "gaussian")], n_boot=20)
    with pytest.raises(ValueError, match="more than one task"):
        bench.aggregate([_record(0, "dppo", task="lift"), _record(1, "dppo", task="can")], n_boot=20)

    lift_dir, can_dir = tmp_path / "lift", tmp_path / "can"
    lift_dir.mkdir(), can_dir.mkdir()
    (lift_dir / "seed1_dppo.json").write_text(json.dumps(_record(1, "dppo")))
    (can_dir / "seed0_dppo.json").write_text(json.dumps(can_dppo))
    (can_dir / "seed0_gaussian.json").write_text(json.dumps(can_gauss))
    out = ["--aggregate", "--out-dir", str(tmp_path / "agg"), "--n-boot", "20"]
    with pytest.raises(ValueError, match=f"more than one task: can: {re.escape(str(can_dir))}.*; lift: "
                                         f"{re.escape(str(lift_dir))}"):
        bench.main(out + ["--task", "can", "--aggregate-dirs", str(can_dir), str(lift_dir)])
    with pytest.raises(ValueError, match="the records are can runs; aggregate them with --task can"):
        bench.main(out + ["--aggregate-dirs", str(can_dir)])
    titles = []
    monkeypatch.setattr("matplotlib.figure.Figure.suptitle", lambda self, text, **kw: titles.append(text))
    assert bench.main(out + ["--task", "can", "--aggregate-dirs", str(can_dir), "--plot",
                             str(tmp_path / "can.png")]) == 0
    assert json.loads((tmp_path / "agg" / "aggregate.json").read_text())["task"] == "can"
    assert (tmp_path / "agg" / "aggregate.md").read_text().endswith("- task: can\n")
    assert titles and titles[0].startswith("robosuite PickPlaceCan: BC -> DPPO vs BC -> Gaussian PPO")
