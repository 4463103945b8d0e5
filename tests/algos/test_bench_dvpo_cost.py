"""bench/bench_dvpo_cost.py: the counted bytes of a step's models and optimizer, and the side-by-side summary, on
hand values."""

from __future__ import annotations

import types

import pytest
import torch
from bench_support import load_bench

cost = load_bench("bench_dvpo_cost")


def _module(value_model: bool, trained_critic: bool):
    """A stand-in with a policy of 10 + 2 float32 parameters, a float16 reference of 12, optionally a value model
    of 5 + 1 float32 parameters (in the optimizer when trained); AdamW after one step (exp_avg, exp_avg_sq of
    every trained parameter and a float32 scalar step each)."""
    policy = torch.nn.Linear(5, 2)  # 10 + 2
    reference = torch.nn.Linear(5, 2).half()
    critic = torch.nn.Linear(5, 1) if value_model else None  # 5 + 1
    groups = [{"params": list(policy.parameters())}]
    if trained_critic:
        groups.append({"params": list(critic.parameters())})
    else:
        if critic is not None:
            critic.requires_grad_(False)
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    loss = policy(torch.ones(1, 5)).sum() + (critic(torch.ones(1, 5)).sum() if trained_critic else 0)
    loss.backward()
    optimizer.step()
    return types.SimpleNamespace(model=policy, reference_model=reference, value_model=critic,
                                 optimizers=lambda: optimizer)


def test_counted_bytes_of_grpo_ppo_and_dvpo_shapes():
    grpo = cost.counted_bytes(_module(value_model=False, trained_critic=False))
    assert grpo == {"params_policy": 48, "params_reference": 24, "params_value_model": 0, "gradients": 48,
                    # 2 tensors x 12 float32 + one float32 step per parameter tensor (2)
                    "optimizer_state": 2 * 48 + 2 * 4, "total": 48 + 24 + 48 + 104}
    ppo = cost.counted_bytes(_module(value_model=True, trained_critic=True))
    assert ppo["params_value_model"] == 24 and ppo["gradients"] == 72
    assert ppo["optimizer_state"] == 2 * 72 + 4 * 4 and ppo["total"] == 48 + 24 + 24 + 72 + 160
    dvpo = cost.counted_bytes(_module(value_model=True, trained_critic=False))  # frozen: no gradient, no state
    assert dvpo["params_value_model"] == 24 and dvpo["gradients"] == 48 and dvpo["optimizer_state"] == 104
    assert dvpo["total"] == ppo["total"] - 24 - 56


def _run(algo, walls, cpus, peak_mib, before_mib, total, load):
    counted = {"params_policy": 100, "params_reference": 100, "params_value_model": 0 if algo == "grpo" else 100,
               "gradients": 100, "optimizer_state": 200, "total": total}
    return {"algo": algo, "wall_s": walls, "cpu_s": cpus, "peak_rss_bytes": peak_mib * 2**20,
            "rss_before_module_bytes": before_mib * 2**20, "counted_bytes": counted, "loadavg_start": [load, 0, 0],
            "loadavg_end": [load + 1, 0, 0], "completion_length": 10.0}


def test_summary_takes_medians_without_the_first_step_and_divides_dvpo_by_each():
    runs = [_run("grpo", [9.0, 1.0, 3.0], [9.0, 1.0, 1.0], 500, 400, 500, 2.0),
            _run("grpo", [9.0, 2.0, 2.0], [9.0, 1.0, 1.0], 520, 400, 500, 2.0),
            _run("ppo", [9.0, 4.0, 4.0], [9.0, 2.0, 2.0], 600, 400, 800, 3.0),
            _run("dvpo", [9.0, 2.0, 4.0], [9.0, 1.5, 1.5], 550, 400, 600, 4.0)]
    summary, table = cost.summarize(runs)
    grpo = summary["sides"]["grpo"]
    assert grpo["step_wall_s_runs"] == [2.0, 2.0] and grpo["step_wall_s_median"] == 2.0
    assert grpo["peak_rss_mib_median"] == 510 and summary["sides"]["dvpo"]["step_wall_s_median"] == 3.0
    lines = table.splitlines()
    assert lines[2] == "| step wall s (median of run medians) | 2.00 | 4.00 | 3.00 | 0.75 | 1.50 |"
    assert lines[3] == "| step CPU s (median of run medians) | 1.00 | 2.00 | 1.50 | 0.75 | 1.50 |"
    assert lines[4] == "| peak RSS MiB (median) | 510 | 600 | 550 | 0.92 | 1.08 |"
    assert "| counted params value model MiB | 0.0 | 0.0 | 0.0 | - | - |" in lines  # GRPO has none: no ratio
    total = next(line for line in lines if line.startswith("| counted total"))
    assert total.endswith(f"| {600 / 800:.2f} | {600 / 500:.2f} |")
    assert summary["loadavg_1min"] == [2.0, 3.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0]
    assert lines[-1].startswith("1-minute load average over the runs: min 2.0, median 3.0, max 5.0")


def test_cost_refuses_a_source_without_the_value_model(tmp_path):
    (tmp_path / "sft" / "hf").mkdir(parents=True)
    (tmp_path / "sft" / "hf" / "config.json").write_text("{}")  # the SFT start, but no value model
    with pytest.raises(SystemExit, match="dvpo_value/hf is missing"):
        cost.main(["--from", str(tmp_path), "--out", str(tmp_path / "out")])
