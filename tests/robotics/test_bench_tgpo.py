"""bench/bench_tgpo_pointmass.py: per-run resume (a stopped command loses only the run in progress) and the summary's
intervals and paired differences on hand-computed values. Training itself is replaced by a fake ``run``."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench_support import load_bench


def _fake_run(calls, fail_on=None):
    def run(task, variant, seed, iterations, eval_every, temperature=1.0):
        calls.append((variant, seed))
        if (variant, seed) == fail_on:
            raise KeyboardInterrupt  # the command stopped in this run
        rate = 0.25 * seed + (0.5 if variant == "mh" else 0.0)
        curve = [{"iteration": i, "env_steps": 640.0 * i, "eval_success_rate": rate * i / iterations}
                 for i in range(1, iterations + 1, eval_every)]
        return {"task": task, "variant": variant, "sampler": variant, "temperature": temperature, "seed": seed,
                "iterations": iterations, "curve": curve, "seconds": 1.0}
    return run


def _args(tmp_path, **overrides):
    args = {"task": "stl_pointmass2", "variants": ["mh", "uniform"], "seeds": [0, 1], "iterations": 3,
            "eval_every": 1, "temperature": 0.02, "out": tmp_path / "k2"}
    return argparse.Namespace(**{**args, **overrides})


def test_a_stopped_command_resumes_run_by_run(tmp_path, monkeypatch):
    bench = load_bench("bench_tgpo_pointmass")
    calls = []
    monkeypatch.setattr(bench, "run", _fake_run(calls, fail_on=("uniform", 1)))
    with pytest.raises(KeyboardInterrupt):
        bench.run_all(_args(tmp_path))
    assert calls == [("mh", 0), ("uniform", 0), ("mh", 1), ("uniform", 1)]  # seed by seed
    runs = tmp_path / "k2.runs"
    # only MH runs carry the temperature in their name
    assert sorted(p.name for p in runs.iterdir()) == ["mh_T0.02_seed0.json", "mh_T0.02_seed1.json",
                                                      "uniform_seed0.json"]
    assert not (tmp_path / "k2.json").exists()
    saved = json.loads((runs / "mh_T0.02_seed1.json").read_text())
    assert saved["settings"] == {"task": "stl_pointmass2", "iterations": 3, "eval_every": 1} and saved["commit"]

    calls.clear()
    monkeypatch.setattr(bench, "run", _fake_run(calls))
    bench.run_all(_args(tmp_path))
    assert calls == [("uniform", 1)]  # the finished runs are kept
    combined = json.loads((tmp_path / "k2.json").read_text())
    assert [(r["variant"], r["seed"]) for r in combined["runs"]] == [("mh", 0), ("uniform", 0), ("mh", 1),
                                                                      ("uniform", 1)]
    assert (tmp_path / "k2.png").exists()
    with pytest.raises(SystemExit, match="was run with"):  # other settings, same folder
        bench.run_all(_args(tmp_path, iterations=4))


def test_summary_intervals_and_paired_differences(tmp_path, capsys):
    bench = load_bench("bench_tgpo_pointmass")

    def runs(variant, finals, task="stl_pointmass3"):
        return [{"task": task, "variant": variant, "sampler": variant, "seed": s, "temperature": 1.0,
                 "curve": [{"eval_success_rate": 0.0}, {"eval_success_rate": f}]} for s, f in enumerate(finals)]

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs("mh", [1.0, 0.5, 0.0]) + runs("uniform", [0.5, 0.5, 0.5])
                                + runs("flat", [0.0, 0.0], task="stl_pointmass3_robustness")}))
    bench.summarise([path], tmp_path / "s")
    out = capsys.readouterr().out
    # mean 0.5, sd 0.5 over 3 seeds: half-width t(0.975, 2) * 0.5 / sqrt(3) = 4.302653 * 0.288675 = 1.242
    assert "TGPO, tau by critic-guided MH, K = 3: final 0.500 +- 1.242" in out
    # mean of the last two evaluations: 0.5, 0.25, 0 -> mean 0.25, sd 0.25 -> half-width 0.621
    assert "mean of the last two evaluations 0.250 +- 0.621" in out
    # MH - uniform per seed: +0.5, 0, -0.5 -> 0 +- 1.242; flat has only seeds 0 and 1: MH - flat = 1.0, 0.5
    assert "K = 3, final: [TGPO, tau by critic-guided MH] - [TGPO, tau uniform] = +0.000 +- 1.242" in out
    half = 12.706205 * np.std([1.0, 0.5], ddof=1) / np.sqrt(2)  # t(0.975, 1) = 12.706
    assert f"[TGPO, tau by critic-guided MH] - [PPO, terminal robustness] = +0.750 +- {half:.3f}" in out
    assert (tmp_path / "s.png").exists()
    with pytest.raises(SystemExit, match="exists"):
        bench.summarise([path], tmp_path / "s")


def test_reacher_diagnosis_ik_by_hand_and_the_scripted_paths():
    from mmpo.robotics.envs.make import make_env

    diag = load_bench("diagnose_tgpo_reacher")
    # stretched along x: both joints 0; |p|^2 = l1^2 + l2^2 puts the elbow at 90 deg and the shoulder at 0
    assert np.allclose(diag.ik(np.array([0.21, 0.0]), 1.0), [0.0, 0.0], atol=1e-6)  # arccos near 1
    assert np.allclose(diag.ik(np.array([0.1, 0.11]), 1.0), [0.0, np.pi / 2])
    assert np.allclose(diag.ik(np.array([0.1, -0.11]), -1.0), [0.0, -np.pi / 2])
    results = {}
    for task in ("stl_reacher2", "stl_reacher2_inner"):
        env = make_env(task, seed=0).unwrapped
        results[task] = {path: diag.episode(env, path, seed=0) for path in ("arc", "chord")}
        env.close()
    # the direct (arc) path runs through stl_reacher2's obstacle and clears the inner one; the chord the reverse
    (rho, entered, _), (chord_rho, chord_entered, _) = results["stl_reacher2"]["arc"], results["stl_reacher2"]["chord"]
    assert rho < 0 and entered and 0 < chord_rho < 0.01 and not chord_entered
    (rho, entered, _), (chord_rho, chord_entered, _) = (results["stl_reacher2_inner"]["arc"],
                                                        results["stl_reacher2_inner"]["chord"])
    assert rho > 0.03 and not entered and chord_rho < 0 and chord_entered


def test_reacher_ablation_registers_the_chosen_task():
    import gymnasium as gym

    from mmpo.robotics.envs.make import make_env
    from mmpo.robotics.envs.tasks import OBS_KEYS, TASKS

    ablate = load_bench("ablate_tgpo_reacher")
    task = ablate.register("reacherabltest", "inner", 2.0)
    names = (task, task + "_robustness")
    try:
        assert task == "stl_reacherabltest2"
        for name, mode in zip(names, ("stage", "robustness")):
            env = make_env(name, seed=0).unwrapped
            obstacle = env.formula.children[1].child.child
            assert (env.distance_scale, env.reward_mode, env.horizon) == (2.0, mode, 60)
            assert np.allclose(obstacle.center, [0.07 * np.cos(np.deg2rad(105)), 0.07 * np.sin(np.deg2rad(105))])
            env.close()
    finally:  # leave the registries as they were (tests/robotics/test_task_registry.py lists every task)
        for name in names:
            TASKS.pop(name, None), OBS_KEYS.pop(name, None)
        for env_id in ("MmpoAblationreacherabltest-v0", "MmpoAblationreacherabltest_robustness-v0"):
            gym.registry.pop(env_id, None)
