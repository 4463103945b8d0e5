"""bench/bench_finetuner_throughput.py: options, ABBA order, the per-method collectors built from the configs, the
process-tree CPU clock, the summary maths on hand values, and a tiny run of a side."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench_support import load_bench

bench = load_bench("bench_finetuner_throughput")


def test_parse_args_defaults_and_errors():
    args = bench.parse_args([])
    assert args.sides == ["raw", "dppo", "reinflow", "fpo", "dsrl", "dsrl_na"]
    assert (args.task, args.rounds, args.num_envs, args.n_steps, args.warmup, args.rollouts, args.tiny) == (
        "lift", 3, 2, 25, 1, 1, False)
    args = bench.parse_args(["--sides", "raw", "fpo", "--rounds", "2", "--n-steps", "50", "--rollouts", "2"])
    assert (args.sides, args.rounds, args.n_steps, args.rollouts) == (["raw", "fpo"], 2, 50, 2)
    for bad in (["--rounds", "0"], ["--n-steps", "0"], ["--rollouts", "0"], ["--warmup", "-1"], ["--sides", "ppo"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_round_order_is_abba():
    sides = ["raw", "dppo", "fpo"]
    assert [bench.round_order(sides, r) for r in range(3)] == [
        ["raw", "dppo", "fpo"], ["fpo", "dppo", "raw"], ["raw", "dppo", "fpo"]]


def test_summary_on_hand_values():
    runs = {"raw": [{"env_steps": 200.0, "wall_s": 1.0, "cpu_s": 1.6}, {"env_steps": 200.0, "wall_s": 2.0, "cpu_s": 1.8}],
            "dppo": [{"env_steps": 200.0, "wall_s": 0.8, "cpu_s": 1.0}, {"env_steps": 200.0, "wall_s": 2.5, "cpu_s": 1.2}]}
    table = bench.summarise(runs)
    # raw: 200 and 100 steps/s, 8 and 9 CPU-ms per step; dppo: 250 and 80 steps/s, 5 and 6 CPU-ms per step
    assert table["raw"] == pytest.approx({"steps_per_s": 150.0, "min": 100.0, "max": 200.0, "cpu_ms_per_step": 8.5,
                                          "x_raw": 1.0, "x_raw_paired_median": 1.0, "cpu_x_raw": 1.0})
    assert table["dppo"] == pytest.approx({"steps_per_s": 165.0, "min": 80.0, "max": 250.0, "cpu_ms_per_step": 5.5,
                                           "x_raw": 1.1, "x_raw_paired_median": (1.25 + 0.8) / 2,
                                           "cpu_x_raw": 5.5 / 8.5})
    text = bench.format_table(table)
    assert "| dppo | 165.0 | 80.0 | 250.0 | 5.50 | 1.10 | 1.02 | 0.65 |" in text
    no_raw = bench.summarise({"fpo": runs["dppo"]})
    assert "x_raw" not in no_raw["fpo"] and "x raw" not in bench.format_table(no_raw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bc")
    return {config: str(bench.save_bc_checkpoint(config, root / f"{config}.ckpt", tiny=True))
            for config in ("bc_lift.yaml", "flow_bc_lift.yaml")}


def test_bc_checkpoint_has_the_config_architecture(tmp_path):
    import torch

    saved = torch.load(bench.save_bc_checkpoint("flow_bc_lift.yaml", tmp_path / "flow.ckpt"), weights_only=True)
    config = saved["robotics"]["policy_config"]
    assert config["family"] == "flow" and config["hidden_dims"] == [512, 512, 512] and config["denoising_steps"] == 4


def test_collectors_from_the_configs(checkpoints):
    from mmpo.robotics.dppo import DPPOModule
    from mmpo.robotics.dsrl import DSRLModule
    from mmpo.robotics.fpo import FPOModule
    from mmpo.robotics.reinflow import ReinFlowModule

    args = bench.parse_args(["--tiny", "--num-envs", "3", "--n-steps", "7"])
    modules = {method: bench.build_collector(method, checkpoints[bc], args) for method, (_, bc) in bench.METHODS.items()}
    assert [type(m) for m in modules.values()] == [DPPOModule, ReinFlowModule, FPOModule, DSRLModule, DSRLModule]
    envs = {method: module.env for method, module in modules.items()}
    assert all(env == envs["dppo"] for env in envs.values())  # one vector-env setting for every side
    env = envs["dppo"]
    assert (env.num_envs, env.n_steps, env.env_groups, env.asynchronous, env.reset_at_iteration,
            env.skip_final_autoreset, env.prefetch_reset) == (3, 7, 1, True, True, True, False)
    assert all(m.evaluation.every == 0 and m.act_steps == 4 and m.task == "lift" for m in modules.values())
    # the configs' own method settings
    assert modules["dppo"].policy.ft_steps == 10 and modules["dppo"].policy.schedule.num_chain_steps == 20
    assert modules["reinflow"].reinflow.noise_hidden_dims == [256, 256, 256]
    assert modules["fpo"].fpo.mc_samples == 8
    dsrl, dsrl_na = modules["dsrl"], modules["dsrl_na"]
    assert (dsrl.aliased, dsrl_na.aliased, dsrl.noise_magnitude, dsrl_na.noise_magnitude) == (False, True, 1.5, 1.0)
    for module in (dsrl, dsrl_na):  # past the warm-up: the noise actor acts; the buffer is small
        assert not module.warming_up() and module.buffer.capacity == 21
        assert module.dsrl.hidden_dims == [bench.TINY_WIDTH] * 2 and module.dsrl.utd == 30
    assert bench.build_collector("dsrl", checkpoints["flow_bc_lift.yaml"],
                                 bench.parse_args([])).dsrl.hidden_dims == [2048, 2048, 2048]


def test_tree_cpu_counts_descendants():
    script = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while bench._cpu_s_of(child.pid) < 0.3 and time.time() < deadline:
            time.sleep(0.05)
        assert child.pid in bench.descendant_pids(os.getpid())
        assert bench.tree_cpu_s() - bench._cpu_s_of(os.getpid()) >= 0.29
    finally:
        child.communicate(b"")


@pytest.mark.parametrize("side", ["raw", "fpo"])
def test_run_side_times_the_rollouts(side, checkpoints, monkeypatch):
    monkeypatch.setattr(bench, "_single_thread", lambda: None)  # the test process keeps its threads
    args = bench.parse_args(["--tiny", "--num-envs", "1", "--n-steps", "2", "--warmup", "1", "--rollouts", "2"])
    result = bench.run_side(side, checkpoints, args)
    assert result["env_steps"] == 2 * 1 * 2 * 4  # 2 timed rollouts x 1 env x 2 chunk steps x 4 actions
    assert result["wall_s"] > 0 and result["cpu_s"] > 0  # the workers' CPU included


@pytest.mark.slow
def test_main_one_tiny_round(tmp_path, capsys):
    """The driver end to end: one subprocess per side, a JSON record, the table against raw (~30 s)."""
    import json

    out = tmp_path / "runs.json"
    assert bench.main(["--tiny", "--sides", "raw", "fpo", "--rounds", "1", "--num-envs", "1", "--n-steps", "2",
                       "--warmup", "0", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["env_steps"] for r in record["runs"]["raw"] + record["runs"]["fpo"]] == [8.0, 8.0]
    assert record["summary"]["raw"]["x_raw"] == 1.0
    assert "| fpo |" in capsys.readouterr().out
