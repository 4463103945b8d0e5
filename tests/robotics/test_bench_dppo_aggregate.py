"""The DPPO benches' aggregation of per-episode records into paired arrays (issue 19); the intervals themselves
(mmpo.eval.stats) are tested on hand-computed values in tests/vlm/test_eval_stats.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench_support import load_bench


def test_aggregate_pairs_episodes_on_their_keys(monkeypatch):
    bench = load_bench("bench_dppo_vs_gaussian")

    def episodes(successes, order):
        return [{"env": e, "ordinal": k, "success": successes[(e, k)]} for e, k in order]

    keys = [(0, 0), (1, 0), (0, 1), (1, 1)]
    record = {"seed": 0, "status": "done", "env_steps": 1000.0, "rl_iterations": 2, "rl_seconds": 10.0,
              "bc_seconds": 1.0, "rollout_env_steps_per_s": 100.0, "faults": 0.0, "curve": []}
    # DPPO: 1/4 -> 3/4; Gaussian: 2/4 -> 2/4; the episodes are listed in different orders (finishing order)
    dppo = {**record, "method": "dppo",
            "before_episodes": episodes({(0, 0): 1, (1, 0): 0, (0, 1): 0, (1, 1): 0}, keys),
            "after_episodes": episodes({(0, 0): 1, (1, 0): 1, (0, 1): 1, (1, 1): 0}, keys[::-1])}
    gaussian = {**record, "method": "gaussian",
                "before_episodes": episodes({(0, 0): 1, (1, 0): 1, (0, 1): 0, (1, 1): 0}, keys[1:] + keys[:1]),
                "after_episodes": episodes({(0, 0): 0, (1, 0): 1, (0, 1): 1, (1, 1): 0}, keys)}
    result = bench.aggregate([dppo, gaussian, {"seed": 1, "method": "dppo", "status": "rl", "curve": []}], n_boot=100)
    assert result["methods"]["dppo"]["before"] == [0.25] and result["methods"]["dppo"]["after"] == [0.75]
    assert result["methods"]["gaussian"]["gain"]["estimate"] == 0.0
    difference = result["contrasts"]["dppo_gain_minus_gaussian_gain"]
    assert difference["estimate"] == pytest.approx(0.5) and difference["seeds"] == [0]
    assert result["methods"]["dppo"]["env_steps_per_s_overall"] == [100.0]
    assert result["unfinished"] == [{"seed": 1, "method": "dppo", "status": "rl", "iterations": 0, "env_steps": 0.0}]
    assert "| DPPO (diffusion) | 0 | 4 |" in bench.markdown(result)


def test_aggregate_pairs_one_method_rerun_with_the_other_methods_records(tmp_path):
    """--aggregate-dirs dppo=A gaussian=B: B's Gaussian rerun pairs with A's DPPO on A's seeds; A B (both
    holding Gaussian seed 0) is an error; --aggregate-seeds keeps the named seeds; the settings are reported."""
    bench = load_bench("bench_dppo_vs_gaussian")

    def record(seed, method, before, after, **extra):
        return {"seed": seed, "method": method, "status": "done", "env_steps": 1000.0, "rl_iterations": 2,
                "rl_seconds": 10.0, "bc_seconds": 1.0, "rollout_env_steps_per_s": 100.0, "faults": 0.0, "curve": [],
                "before_episodes": [{"env": 0, "ordinal": k, "success": v} for k, v in enumerate(before)],
                "after_episodes": [{"env": 0, "ordinal": k, "success": v} for k, v in enumerate(after)], **extra}

    run_e, rerun = tmp_path / "main", tmp_path / "gauss_tuned"
    run_e.mkdir(), rerun.mkdir()
    args = {"actor_lr": 1e-4, "update_epochs": 10, "batch_size": 600, "clip_base": 0.001, "clip_final": 0.01,
            "gaussian_clip": 0.01, "gaussian_batch_size": 60}  # a record from before the --gaussian-* options
    tuned = {"actor_lr": 1e-5, "target_kl": 0.02, "update_epochs": 10, "batch_size": 60, "clip_base": 0.01,
             "clip_final": 0.01}
    for seed in (0, 1):
        # DPPO 0/4 -> 2/4 on both seeds; Run E's Gaussian 2/4 -> 2/4; the rerun's Gaussian 2/4 -> 4/4
        (run_e / f"seed{seed}_dppo.json").write_text(
            json.dumps(record(seed, "dppo", [0, 0, 0, 0], [1, 1, 0, 0], args=args)))
        (run_e / f"seed{seed}_gaussian.json").write_text(
            json.dumps(record(seed, "gaussian", [1, 1, 0, 0], [1, 1, 0, 0], args=args)))
    (rerun / "seed0_gaussian.json").write_text(json.dumps(record(
        0, "gaussian", [1, 1, 0, 0], [1, 1, 1, 1], rl_settings=tuned,
        bc_reused={"from": str(run_e / "seed0" / "gaussian" / "bc.ckpt")})))
    with pytest.raises(ValueError, match="seed 0 gaussian is in .*METHOD=DIR"):
        bench.load_records([str(run_e), str(rerun)])

    records = bench.load_records([f"dppo={run_e}", f"gaussian={rerun}"])
    assert sorted((r["seed"], r["method"]) for r in records) == [(0, "dppo"), (0, "gaussian"), (1, "dppo")]
    result = bench.aggregate(records, n_boot=50)
    assert result["methods"]["gaussian"]["after"] == [1.0] and result["methods"]["dppo"]["seeds"] == [0, 1]
    assert result["methods"]["gaussian"]["rl_settings"] == [tuned]
    # DPPO gain 0.5 - Gaussian gain 0.5 = 0; DPPO final 0.5 - Gaussian final 1.0 = -0.5 (seed 0 only)
    assert result["contrasts"]["dppo_gain_minus_gaussian_gain"]["estimate"] == 0.0
    assert result["contrasts"]["dppo_after_minus_gaussian_after"]["estimate"] == -0.5
    assert result["contrasts"]["dppo_gain_minus_gaussian_gain"]["seeds"] == [0]

    out = tmp_path / "agg"
    assert bench.main(["--aggregate", "--aggregate-dirs", f"dppo={run_e}", f"gaussian={rerun}", "--aggregate-seeds",
                       "0", "--out-dir", str(out), "--n-boot", "50"]) == 0
    saved = json.loads((out / "aggregate.json").read_text())
    assert saved["methods"]["dppo"]["seeds"] == [0] and saved["methods"]["dppo"]["rl_settings"] == [
        {"actor_lr": 1e-4, "target_kl": 1.0, "update_epochs": 10, "batch_size": 600, "clip_base": 0.001,
         "clip_final": 0.01}]
    text = (out / "aggregate.md").read_text()
    assert (f"- Gaussian PPO settings (seeds 0): actor lr 1e-05, target_kl 0.02, update epochs 10, clip 0.01, "
            f"minibatch 60 env steps; records {rerun}; BC reused from {run_e}") in text
    assert f"- DPPO (diffusion) settings (seeds 0): actor lr 0.0001, target_kl 1.0, update epochs 10, clip 0.001 -> " \
           f"0.01, minibatch 600 pairs; records {run_e}" in text


def test_episode_tracker_records_name_each_counted_episode_by_env_and_number():
    from mmpo.robotics.evaluate import EpisodeTracker

    records: list = []
    tracker = EpisodeTracker(2, quota=[2, 1], records=records)
    no, yes = False, True
    tracker.update(np.array([1.0, 0.5]), np.array([yes, no]), np.array([no, no]), {})
    tracker.update(np.array([2.0, 0.5]), np.array([yes, no]), np.array([no, yes]), {})
    tracker.update(np.array([3.0, 3.0]), np.array([yes, yes]), np.array([no, no]), {})  # both beyond their quota
    assert records == [
        {"env": 0, "ordinal": 0, "success": False, "return": 1.0, "length": 1},
        {"env": 0, "ordinal": 1, "success": False, "return": 2.0, "length": 1},
        {"env": 1, "ordinal": 0, "success": False, "return": 1.0, "length": 2},
    ]
    assert tracker.complete and len(tracker.returns) == 3


def test_chain_quality_pairs_episodes_on_env_and_ordinal():
    quality = load_bench("bench_dppo_chain_quality")
    runs = {"ddpm": [{"env": 1, "ordinal": 0, "success": True}, {"env": 0, "ordinal": 0, "success": False},
                     {"env": 0, "ordinal": 1, "success": True}],
            "ddim": [{"env": 0, "ordinal": 0, "success": True}, {"env": 1, "ordinal": 0, "success": True},
                     {"env": 1, "ordinal": 1, "success": False}]}
    arrays = quality.paired_arrays(runs)  # shared keys (0, 0) and (1, 0), sorted
    assert arrays["ddpm"].tolist() == [0.0, 1.0] and arrays["ddim"].tolist() == [1.0, 1.0]
    line = quality.summary_lines("stochastic", [arrays], n_boot=10)[0]
    assert line.startswith("| stochastic | 0.500 (0.50) | 1.000 (1.00) | +0.500 |")
