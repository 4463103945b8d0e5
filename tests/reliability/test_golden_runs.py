"""Golden short runs: 2-4 steps of every family's tiny config through `mmpo fit` (VLM SFT + GRPO, dLLM SFT +
diffu-GRPO + IGPO, robotics BC + DPPO) on CPU with one thread must log exactly the committed metrics
(tests/reliability/golden_runs/golden_runs.json). A silent change of the numerics fails here; a deliberate
one regenerates the artifact and updates bench/RESULTS.md, whose recorded numbers moved with it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent / "golden_runs"
GENERATOR = GOLDEN_DIR / "make_golden_runs.py"
RELATIVE_TOLERANCE = 1e-6  # one thread on CPU is bit-reproducible; the margin only absorbs CSV float printing


def _how_to_regenerate() -> str:
    command = json.loads((GOLDEN_DIR / "golden_runs.json").read_text())["command"]
    return (f"\nIf the change of the numerics is intended, regenerate the artifact with\n    {command}\n"
            "and re-run the recorded results of bench/RESULTS.md (python bench/reproduce.py) and update them, "
            "with the commit and the reason.")


def mismatches(golden: dict, current: dict, rel: float = RELATIVE_TOLERANCE) -> list[str]:
    """Every difference between two {run: {step: {metric: value}}} tables: missing runs, steps or metrics
    and values outside ``rel`` (NaN equals NaN). Metrics logged now but not in the golden are allowed."""
    problems = []
    for run, steps in golden.items():
        if run not in current:
            problems.append(f"{run}: not run")
            continue
        if sorted(steps) != sorted(current[run]):
            problems.append(f"{run}: logged steps {sorted(current[run])}, golden {sorted(steps)}")
        for step, metrics in steps.items():
            for key, expected in metrics.items():
                actual = current[run].get(step, {}).get(key)
                if actual is None:
                    problems.append(f"{run} step {step} {key}: not logged (golden {expected})")
                elif expected == "nan" or actual == "nan":
                    if expected != actual:
                        problems.append(f"{run} step {step} {key}: {actual} != golden {expected}")
                elif not math.isclose(actual, expected, rel_tol=rel, abs_tol=1e-12):
                    problems.append(f"{run} step {step} {key}: {actual!r} != golden {expected!r}")
    return problems


@pytest.fixture(scope="module")
def current_runs(tmp_path_factory) -> dict:
    """All families in one fresh interpreter with OMP/MKL at one thread (the generator sets it before torch)."""
    out = tmp_path_factory.mktemp("golden_now") / "now.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())["runs"]


GOLDEN = json.loads((GOLDEN_DIR / "golden_runs.json").read_text())["runs"]


@pytest.mark.parametrize("run", sorted(GOLDEN))
def test_short_run_logs_the_golden_metrics(run, current_runs):
    problems = mismatches({run: GOLDEN[run]}, current_runs)
    assert not problems, "\n".join(problems[:20]) + _how_to_regenerate()


def test_every_family_is_pinned_with_its_training_signals():
    families = {run.split("/")[0] for run in GOLDEN}
    assert families == {"vlm", "dllm", "robotics"}
    pinned = {key for steps in GOLDEN.values() for metrics in steps.values() for key in metrics}
    for key in ("losses/sft", "losses/bc_step", "losses/policy", "losses/value", "losses/kl", "policy/grad_norm",
                "policy/clipfrac", "rewards/total/mean", "igpo/frac_all_wrong"):
        assert key in pinned, key
    assert not any(key.startswith("perf/") and key.endswith(("_s", "_per_s")) for key in pinned)  # no timings


def test_mismatch_report_names_run_step_metric_and_values():
    golden = {"a/x": {"0": {"loss": 1.0, "nan_metric": "nan"}, "1": {"loss": 2.0}}}
    assert mismatches(golden, golden) == []
    assert mismatches(golden, {"a/x": {"0": {"loss": 1.0 + 1e-9, "nan_metric": "nan", "new": 3.0},
                                       "1": {"loss": 2.0}}}) == []
    changed = {"a/x": {"0": {"loss": 1.001, "nan_metric": 0.5}, "1": {}}}
    assert mismatches(golden, changed) == [
        "a/x step 0 loss: 1.001 != golden 1.0", "a/x step 0 nan_metric: 0.5 != golden nan",
        "a/x step 1 loss: not logged (golden 2.0)"]
    assert mismatches(golden, {}) == ["a/x: not run"]
