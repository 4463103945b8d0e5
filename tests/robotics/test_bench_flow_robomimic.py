"""bench/bench_flow_robomimic.py (issue 44): options, the per-method budget in env steps, the modules each method
builds from its config, the task queue shared by two workers, and the pooled aggregate with pairwise contrasts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench_support import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_flow_robomimic")


def test_options_and_budget_in_env_steps(bench):
    args = bench.parse_args(["--env-steps", "3000", "--max-minutes", "6"])
    assert (args.task, args.noise, args.max_episode_steps, args.n_steps, args.num_envs) == ("lift", 0.5, 150, 38, 4)
    assert args.methods == ["dppo", "reinflow", "fpo", "dsrl"] and args.eval_episodes == 100
    # the shared options the bench pipeline reads (fit_rl's wall cap) follow the new names
    assert (args.dppo_env_steps, args.dppo_max_minutes, args.env_steps, args.max_minutes) == (3000, 6.0, 3000, 6.0)
    # 4 envs x one 150-step episode (38 chunk steps of 4 actions stop at the time limit): 600 env steps per iteration
    assert bench.plan(args) == {"iterations": 5, "env_steps_per_iteration": 600, "env_steps": 3000,
                                "chunk_steps_per_env": 190}
    # a budget between iterations rounds up to whole iterations
    assert bench.plan(bench.parse_args(["--env-steps", "3001"]))["iterations"] == 6
    # episodes longer than a rollout: n_steps x 4 per env
    short = bench.parse_args(["--env-steps", "1000", "--n-steps", "10", "--num-envs", "2"])
    assert bench.plan(short) == {"iterations": 13, "env_steps_per_iteration": 80, "env_steps": 1040,
                                 "chunk_steps_per_env": 130}
    with pytest.raises(SystemExit):
        bench.parse_args(["--dsrl-utd", "0"])


def test_each_method_builds_its_config_with_the_bench_budget(bench):
    args = bench.parse_args(["--env-steps", "3000", "--dsrl-hidden", "64", "64", "--dsrl-utd", "5",
                             "--dsrl-warmup-iterations", "2", "--sync-envs"])
    paths = {}
    for method in bench.METHODS:
        class_path, settings = bench.module_settings(method, Path("bc.ckpt"), args, seed=3)
        paths[method] = class_path
        assert settings["bc_checkpoint"] == "bc.ckpt" and settings["num_iterations"] == 5 and settings["seed"] == 3
        assert settings["evaluation"]["every"] == 0
        env = settings["env"]
        assert (env["num_envs"], env["n_steps"], env["max_episode_steps"], env["asynchronous"]) == (4, 38, 150, False)
        assert env["reset_at_iteration"] is True  # the config's, kept
        assert "bc_checkpoint" not in bench.settings_record(settings)
    assert paths == {"dppo": "mmpo.robotics.dppo.DPPOModule", "reinflow": "mmpo.robotics.reinflow.ReinFlowModule",
                     "fpo": "mmpo.robotics.fpo.FPOModule", "dsrl": "mmpo.robotics.dsrl.DSRLModule"}
    _, reinflow = bench.module_settings("reinflow", Path("bc.ckpt"), args, seed=0)
    assert reinflow["optim"]["lr"] == 2e-5 and reinflow["reinflow"]["clip"] == 0.01  # reinflow_lift.yaml's
    _, fpo = bench.module_settings("fpo", Path("bc.ckpt"), args, seed=0)
    assert fpo["fpo"]["mc_samples"] == 8 and fpo["optim"]["lr"] == 1e-4
    _, dsrl = bench.module_settings("dsrl", Path("bc.ckpt"), args, seed=0)
    # the CPU changes (widths, utd, warm-up as whole iterations of 38 chunk steps), a buffer of the whole run
    # (5 iterations x 38 chunk steps x 4 envs), the rest dsrl_lift.yaml's
    assert {k: dsrl["dsrl"][k] for k in ("hidden_dims", "utd", "warmup_chunk_steps", "buffer_size", "action_magnitude",
                                         "tau", "reward_offset")} == {
        "hidden_dims": [64, 64], "utd": 5, "warmup_chunk_steps": 76, "buffer_size": 760, "action_magnitude": 1.5,
        "tau": 0.005, "reward_offset": 1.0}
    assert bench.FAMILY == {"dppo": "diffusion", "reinflow": "flow", "fpo": "flow", "dsrl": "flow"}
    assert bench.eval_sampler("dppo", args) == "args" and bench.eval_sampler("diffusion", args) == "args"
    assert bench.eval_sampler("dsrl", args) is None and bench.eval_sampler("flow", args) is None


def test_fpo_lr_and_validation_episodes_options(bench):
    args = bench.parse_args(["--task", "can", "--fpo-lr", "1e-5", "--eval-seed-base", "200000"])
    _, fpo = bench.module_settings("fpo", Path("bc.ckpt"), args, seed=0)
    # only the actor lr changes; the rest of the optim group is the config's
    assert fpo["optim"]["lr"] == 1e-5 and fpo["optim"]["minibatch_size"] == 500 and fpo["critic"]["lr"] == 1e-3
    _, reinflow = bench.module_settings("reinflow", Path("bc.ckpt"), args, seed=0)
    assert reinflow["optim"]["lr"] == 2e-5
    assert args.eval_seed_base == 200_000 and bench.parse_args([]).eval_seed_base == 100_000
    with pytest.raises(SystemExit):
        bench.parse_args(["--fpo-lr", "0"])
    # evaluations are the same episodes only with the same seed base (records from before the option: 100000),
    # episode count, envs, episode length, sampler and task
    test = vars(bench.parse_args(["--task", "can"]))
    old = {k: v for k, v in test.items() if k != "eval_seed_base"}
    assert bench.same_evaluation(old, test) and not bench.same_evaluation(old, vars(args))
    assert not bench.same_evaluation({**old, "eval_episodes": 50}, test)


def test_can_runs_with_can_settings_and_its_own_config_where_one_exists(bench):
    args = bench.parse_args(["--task", "can", "--env-steps", "6000", "--sync-envs"])
    # Can's bench defaults (mmpo/robotics/bench.py TASK_DEFAULTS): demo noise 0.3, 300-step episodes (the DPPO paper's
    # Can config), so one episode per env is 75 chunk steps; 4 envs x 300 = 1,200 env steps per iteration
    assert (args.task, args.noise, args.max_episode_steps, args.n_steps) == ("can", 0.3, 300, 75)
    assert bench.plan(args) == {"iterations": 5, "env_steps_per_iteration": 1200, "env_steps": 6000,
                                "chunk_steps_per_env": 375}
    spec = bench.task_spec(args)
    assert (spec.sim_name, spec.obs_dim, spec.action_dim) == ("PickPlaceCan", 23, 7)
    # dppo_can.yaml and fpo_can.yaml (its actor lr chosen on Can) exist; ReinFlow and DSRL read their Lift configs
    # (the official Can ones repeat the Lift settings)
    assert {m: bench.method_config(m, "can") for m in bench.METHODS} == {
        "dppo": "dppo_can.yaml", "reinflow": "reinflow_lift.yaml", "fpo": "fpo_can.yaml", "dsrl": "dsrl_lift.yaml"}
    assert {m: bench.method_config(m, "lift") for m in bench.METHODS} == {m: f"{m}_lift.yaml" for m in bench.METHODS}
    for method in bench.METHODS:
        _, settings = bench.module_settings(method, Path("bc.ckpt"), args, seed=1)
        env = settings["env"]
        assert (env["num_envs"], env["n_steps"], env["max_episode_steps"]) == (4, 75, 300)
        assert settings["num_iterations"] == 5
    _, fpo = bench.module_settings("fpo", Path("bc.ckpt"), args, seed=1)
    assert fpo["optim"]["lr"] == 3e-5 and fpo["fpo"]["clip"] == 0.05
    _, dsrl = bench.module_settings("dsrl", Path("bc.ckpt"), args, seed=1)
    # one warm-up iteration = 75 chunk steps per env; the buffer holds 5 x 75 x 4 transitions
    assert (dsrl["dsrl"]["warmup_chunk_steps"], dsrl["dsrl"]["buffer_size"]) == (75, 1500)


def test_tasks_are_seed_major_and_wait_for_their_bc(bench, tmp_path):
    args = bench.parse_args(["--seeds", "0", "1", "--methods", "fpo", "dppo"])
    assert bench.tasks(args) == [("bc", "diffusion", 0), ("bc", "flow", 0), ("rl", "fpo", 0), ("rl", "dppo", 0),
                                 ("bc", "diffusion", 1), ("bc", "flow", 1), ("rl", "fpo", 1), ("rl", "dppo", 1)]
    only_flow = bench.parse_args(["--seeds", "0", "--methods", "reinflow"])
    assert bench.tasks(only_flow) == [("bc", "flow", 0), ("rl", "reinflow", 0)]

    def write(task, status):
        path = bench.task_record_path(task, tmp_path)
        path.write_text(json.dumps({"status": status}))

    all_tasks = bench.tasks(args)
    # the first task is claimed; a second worker (another pid holds the claim) gets the next one
    task, pending = bench.next_task(all_tasks, tmp_path)
    assert task == ("bc", "diffusion", 0) and pending
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "claims" / "bc_diffusion_0.lock").write_text(str(holder.pid))
        assert bench.next_task(all_tasks, tmp_path)[0] == ("bc", "flow", 0)
        (tmp_path / "claims" / "bc_flow_0.lock").write_text(str(holder.pid))
        # fpo s0 and dppo s0 wait for their BCs (held by the other worker): seed 1's first BC is next
        assert bench.next_task(all_tasks, tmp_path)[0] == ("bc", "diffusion", 1)
    finally:
        holder.kill()
        holder.wait()
    # the holder died: its claim is taken over
    assert bench.next_task(all_tasks, tmp_path)[0] == ("bc", "diffusion", 0)
    for task in all_tasks:
        bench.release(tmp_path, task)
    write(("bc", "flow", 0), "done")
    write(("bc", "diffusion", 0), "failed")  # dppo s0 can never run: dropped, not waited on
    write(("rl", "fpo", 0), "done")  # finished: skipped
    assert bench.next_task(all_tasks, tmp_path)[0] == ("bc", "diffusion", 1)
    for task in all_tasks[4:]:
        write(task, "done")
    assert bench.next_task(all_tasks, tmp_path) == (None, False)  # nothing pending: the worker returns
    write(("rl", "fpo", 1), "rl")  # a killed run's record is not finished: run again
    assert bench.next_task(all_tasks, tmp_path) == (("rl", "fpo", 1), True)


def _episodes(successes):
    return [{"env": i % 2, "ordinal": i // 2, "success": s} for i, s in enumerate(successes)]


def _record(method, seed, before, after, **extra):
    return {"seed": seed, "method": method, "task": "lift", "status": "done", "env_steps": 600.0, "rl_iterations": 1,
            "rl_seconds": 10.0, "bc_seconds": 1.0, "rollout_env_steps_per_s": 60.0, "faults": 0.0,
            "rl_settings": {"num_iterations": 1}, "plan": {"env_steps": 600}, "cap_bound": False,
            "before_episodes": _episodes(before), "after_episodes": _episodes(after),
            "before": {"success_rate": float(np.mean(before)), "episodes": len(before)},
            "after": {"success_rate": float(np.mean(after)), "episodes": len(after)},
            "curve": [{"perf/env_steps_total": 600.0, "perf/rl_wall_s": 10.0, "charts/success_rate": 0.5}], **extra}


def test_aggregate_gains_and_pairwise_contrasts(bench, tmp_path):
    flow_bc = [1, 0, 0, 0]
    records = [_record("dppo", 0, [0, 0, 1, 1], [1, 1, 1, 1]),  # gain +0.50
               _record("reinflow", 0, flow_bc, [1, 1, 0, 0]),  # +0.25
               _record("fpo", 0, flow_bc, [0, 0, 0, 0]),  # -0.25
               _record("dsrl", 0, flow_bc, [1, 1, 1, 0], cap_bound=True),  # +0.50
               {"seed": 1, "method": "fpo", "task": "lift", "status": "rl", "curve": []}]
    result = bench.aggregate(records, n_boot=200)
    gains = {m: v["gain"]["estimate"] for m, v in result["methods"].items()}
    assert gains == pytest.approx({"dppo": 0.5, "reinflow": 0.25, "fpo": -0.25, "dsrl": 0.5})
    assert result["methods"]["dsrl"]["cap_bound"] == [True] and result["methods"]["fpo"]["cap_bound"] == [False]
    contrasts = {name: c["estimate"] for name, c in result["contrasts"].items()}
    assert contrasts == pytest.approx({
        "dppo_gain_minus_reinflow_gain": 0.25, "dppo_gain_minus_fpo_gain": 0.75, "dppo_gain_minus_dsrl_gain": 0.0,
        "reinflow_gain_minus_fpo_gain": 0.5, "reinflow_gain_minus_dsrl_gain": -0.25, "fpo_gain_minus_dsrl_gain": -0.75})
    assert [u["method"] for u in result["unfinished"]] == ["fpo"]
    text = bench.markdown(result)
    assert "| DPPO (diffusion) | 0 | 4 | 0.50 | 1.00 | 0.500 -> 1.000 | **+0.500** |" in text
    assert "| fpo_gain_minus_dsrl_gain | 0 | | per seed -0.75 |" in text and "| yes |" in text
    plot = tmp_path / "curves.png"
    bench.plot(records, plot)
    assert plot.stat().st_size > 10_000


def test_aggregate_adds_the_stochastic_dsrl_row_paired_with_the_bc_stochastic_evaluation(bench, tmp_path):
    flow_bc = [1, 1, 0, 0]
    stochastic = {"before_stochastic_episodes": _episodes(flow_bc), "after_stochastic_episodes": _episodes([1, 1, 1, 0]),
                  "before_stochastic": {"success_rate": 0.5}, "after_stochastic": {"success_rate": 0.75}}
    records = [_record("reinflow", 0, flow_bc, [1, 1, 0, 0]),  # +0.00
               _record("dsrl", 0, flow_bc, [0, 0, 0, 0], **stochastic)]  # deterministic -0.50, stochastic +0.25
    result = bench.aggregate(records, ("reinflow", "dsrl"), n_boot=200)
    gains = {m: v["gain"]["estimate"] for m, v in result["methods"].items()}
    assert gains == pytest.approx({"reinflow": 0.0, "dsrl": -0.5, "dsrl_stochastic": 0.25})
    assert result["methods"]["dsrl_stochastic"]["before"] == [0.5] and result["methods"]["dsrl_stochastic"]["after"] == [0.75]
    # contrasts only between the deterministic rows
    assert {n: c["estimate"] for n, c in result["contrasts"].items()} == pytest.approx(
        {"reinflow_gain_minus_dsrl_gain": 0.5})
    text = bench.markdown(result)
    assert "| DSRL (flow, SAC), stochastic eval | 0 | 4 | 0.50 | 0.75 | 0.500 -> 0.750 | **+0.250** |" in text
    plot = tmp_path / "curves.png"  # the stochastic evaluation drawn beside the deterministic one
    bench.plot(records, plot, ("reinflow", "dsrl"))
    assert plot.stat().st_size > 10_000
    # a DSRL record without the stochastic evaluations has no such row
    assert "dsrl_stochastic" not in bench.aggregate([_record("dsrl", 0, flow_bc, [0, 0, 0, 0])], ("dsrl",),
                                                     n_boot=50)["methods"]


def test_aggregate_takes_each_method_from_its_own_directory(bench, tmp_path, monkeypatch):
    """METHOD=DIR: FPO from a re-run's directory, the rest from the first run's (which also holds an FPO record)."""
    first, rerun = tmp_path / "first", tmp_path / "rerun"
    first.mkdir(), rerun.mkdir()
    flow_bc = [1, 1, 0, 0]
    for record, directory in ((_record("reinflow", 0, flow_bc, [1, 1, 1, 0]), first),
                              (_record("fpo", 0, flow_bc, [0, 0, 0, 0]), first),
                              (_record("fpo", 0, flow_bc, [1, 1, 1, 1]), rerun)):
        (directory / f"seed0_{record['method']}.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--aggregate", "--out-dir", "agg", "--methods", "reinflow", "fpo", "--seeds", "0",
                       "--n-boot", "50", "--aggregate-dirs", "reinflow=first", "fpo=rerun"]) == 0
    result = json.loads((tmp_path / "agg" / "aggregate.json").read_text())
    assert result["methods"]["fpo"]["after"] == [1.0] and result["methods"]["fpo"]["sources"] == ["rerun/seed0_fpo.json"]
    assert result["methods"]["reinflow"]["after"] == [0.75]
    with pytest.raises(ValueError, match="is in"):  # both FPO records: which to pair would be a silent choice
        bench.main(["--aggregate", "--out-dir", "agg", "--aggregate-dirs", "first", "rerun"])


def test_the_existing_bench_keeps_its_contrasts_and_records_wall_time():
    vs = load_bench("bench_dppo_vs_gaussian")
    record = _record("dppo", 0, [0, 0, 1, 1], [1, 1, 1, 1])
    gaussian = _record("gaussian", 0, [0, 0, 1, 1], [0, 0, 1, 1])
    result = vs.aggregate([record, gaussian], n_boot=100)
    assert result["contrasts"]["dppo_gain_minus_gaussian_gain"]["estimate"] == pytest.approx(0.5)
    # only the methods asked for
    assert list(vs.aggregate([record, gaussian], n_boot=100, methods=("gaussian",))["methods"]) == ["gaussian"]

    class Module:
        last_metrics = {"perf/env_steps_total": 600.0, "perf/env_steps_per_s": 50.0}

    path = Path(os.devnull)
    state = {"method": "dppo", "seed": 0, "curve": [], "_rl_start": 0.0}
    recorder = vs.CurveRecorder(state, path)
    recorder.path = None
    vs.atomic_write_json, saved = (lambda *a, **k: None), vs.atomic_write_json
    try:
        recorder.on_train_batch_end(None, Module(), None, None, 0)
    finally:
        vs.atomic_write_json = saved
    assert state["curve"][0]["perf/rl_wall_s"] > 0 and state["rl_seconds_so_far"] == state["curve"][0]["perf/rl_wall_s"]


def test_a_tiny_lift_run_end_to_end_then_resumes_without_rerunning(bench, tmp_path, monkeypatch):
    """Both BCs, the four fine-tunings (one 8-step iteration each) and the paired evaluations on the real Lift
    simulator with tiny networks and random Lift-shaped demos; a second run finds every record done."""
    from reliability.test_resume_robotics import write_tiny_demos

    demos = write_tiny_demos(tmp_path / "lift.hdf5")
    monkeypatch.chdir(tmp_path)
    argv = ["--out-dir", "out", "--demos", str(demos), "--seeds", "0", "--bc-epochs", "1", "--hidden", "16",
            "--eval-episodes", "2", "--num-envs", "1", "--n-steps", "2", "--max-episode-steps", "8",
            "--env-steps", "8", "--sync-envs", "--dsrl-hidden", "16", "--dsrl-utd", "1",
            "--dsrl-warmup-iterations", "0", "--poll-seconds", "0.1"]
    assert bench.main(argv) == 0
    out = tmp_path / "out"
    records = {m: json.loads((out / f"seed0_{m}.json").read_text()) for m in bench.METHODS}
    flow_bc = json.loads((out / "bc_flow_seed0.json").read_text())
    for method, record in records.items():
        assert record["status"] == "done" and record["env_steps"] == 8.0 and record["rl_iterations"] == 1
        assert record["cap_bound"] is False and record["plan"]["env_steps"] == 8
        # the BC's evaluation is every method's "before"; "after" meets the same episodes
        keys = sorted((e["env"], e["ordinal"]) for e in record["after_episodes"])
        assert keys == sorted((e["env"], e["ordinal"]) for e in record["before_episodes"]) == [(0, 0), (0, 1)]
        assert record["curve"][0]["perf/rl_wall_s"] > 0
    assert records["dsrl"]["before_episodes"] == flow_bc["before_episodes"]
    assert records["dsrl"]["rl_settings"]["dsrl"]["hidden_dims"] == [16]
    # the stochastic evaluations: a flow BC has no noise network, so its stochastic evaluation plays the same
    # seeded x_0 through the same flow as its deterministic one; DSRL's samples its noise, on the same episodes
    assert flow_bc["before_stochastic_episodes"] == flow_bc["before_episodes"]
    assert records["dsrl"]["before_stochastic_episodes"] == flow_bc["before_stochastic_episodes"]
    assert sorted((e["env"], e["ordinal"]) for e in records["dsrl"]["after_stochastic_episodes"]) == [(0, 0), (0, 1)]
    assert set(records["dsrl"]["evaluation_modes"]) == {"before", "before_stochastic", "after", "after_stochastic"}
    assert all("stochastic" not in key for m in ("dppo", "reinflow", "fpo") for key in records[m])
    stamps = {m: r["finished"] for m, r in records.items()}
    assert bench.main(argv) == 0  # resumed: nothing left to run
    assert {m: json.loads((out / f"seed0_{m}.json").read_text())["finished"] for m in bench.METHODS} == stamps
    assert not list((out / "claims").iterdir())

    # --stochastic-only adds them to records written without them (a run from before the option), identically
    keys = ("before_stochastic", "before_stochastic_episodes", "after_stochastic", "after_stochastic_episodes")
    for path in (out / "bc_flow_seed0.json", out / "seed0_dsrl.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in record.items() if k not in keys}))
    assert bench.main([*argv, "--stochastic-only"]) == 0
    added = json.loads((out / "seed0_dsrl.json").read_text())
    for key in keys:  # the same numbers (the evaluation's wall seconds aside)
        if key.endswith("episodes"):
            assert added[key] == records["dsrl"][key]
        else:
            assert {k: v for k, v in added[key].items() if k != "seconds"} == {
                k: v for k, v in records["dsrl"][key].items() if k != "seconds"}
    assert added["stochastic_added"]["commit"] and added["after"] == records["dsrl"]["after"]
    # a record of other episodes than the options give is refused, not evaluated on the wrong ones
    (out / "seed0_dsrl.json").write_text(json.dumps({k: v for k, v in added.items() if k not in keys}))
    other = [*argv[:argv.index("--eval-episodes") + 1], "4", *argv[argv.index("--eval-episodes") + 2:]]
    with pytest.raises(ValueError, match="other episodes"):
        bench.main([*other, "--stochastic-only"])
    (out / "seed0_dsrl.json").write_text(json.dumps(added))

    # --bc-from: FPO alone at another lr from this run's flow BC, on validation episodes (another seed base): the
    # BC is evaluated there, not trained; with the same episodes its evaluation is copied
    val = [*argv[:argv.index("out")], "val", *argv[argv.index("out") + 1:], "--methods", "fpo", "--bc-from", "out",
           "--fpo-lr", "1e-5", "--eval-seed-base", "200000"]
    assert bench.main(val) == 0
    bc_val = json.loads((tmp_path / "val" / "bc_flow_seed0.json").read_text())
    fpo_val = json.loads((tmp_path / "val" / "seed0_fpo.json").read_text())
    assert bc_val["bc_ckpt"] == flow_bc["bc_ckpt"] and bc_val["bc_reused"]["from"] == "out/bc_flow_seed0.json"
    assert "evaluations_copied" not in bc_val["bc_reused"] and not (tmp_path / "val" / "seed0").joinpath(
        "bc_flow").exists()
    assert "before_stochastic" not in bc_val  # no DSRL to pair it with
    assert fpo_val["rl_settings"]["optim"]["lr"] == 1e-5 and fpo_val["args"]["eval_seed_base"] == 200_000
    assert fpo_val["before_episodes"] == bc_val["before_episodes"]
    same = [*argv[:argv.index("out")], "same", *argv[argv.index("out") + 1:], "--methods", "fpo", "--bc-from", "out"]
    import torch

    torch.randn(1000)  # another global RNG state than the first run's: the fine-tuning must not depend on it
    assert bench.main(same) == 0
    bc_same = json.loads((tmp_path / "same" / "bc_flow_seed0.json").read_text())
    assert bc_same["bc_reused"]["evaluations_copied"] == ["before", "before_stochastic"]
    assert bc_same["before_episodes"] == flow_bc["before_episodes"]
    fpo_same = json.loads((tmp_path / "same" / "seed0_fpo.json").read_text())
    # same BC, settings and seed: the same run (its critic's initial weights included)
    assert fpo_same["after_episodes"] == records["fpo"]["after_episodes"]
    assert [c["losses/value"] for c in fpo_same["curve"]] == [c["losses/value"] for c in records["fpo"]["curve"]]
