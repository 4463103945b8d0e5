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
# On another processor type or SIMD level the same code rounds differently: measured 2026-12-01 between an
# Intel AVX-512 machine and the machine that wrote the previous artifact, at most 3.6e-5 absolute (a ratio
# max) and 1.4e-7 absolute on KL values of ~4e-6. These bounds keep a 3x margin over that and still catch
# any change of a formula, a default or a data order, which moves the pinned losses by far more.
CROSS_MACHINE_RELATIVE, CROSS_MACHINE_ABSOLUTE = 1e-3, 1e-4


def _how_to_regenerate() -> str:
    command = json.loads((GOLDEN_DIR / "golden_runs.json").read_text())["command"]
    return (f"\nIf the change of the numerics is intended, regenerate the artifact with\n    {command}\n"
            "and re-run the recorded results of bench/RESULTS.md (python bench/reproduce.py) and update them, "
            "with the commit and the reason.")


def mismatches(golden: dict, current: dict, rel: float = RELATIVE_TOLERANCE, abs_tol: float = 1e-12) -> list[str]:
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
                elif not math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_tol):
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
    return json.loads(out.read_text())


ARTIFACT = json.loads((GOLDEN_DIR / "golden_runs.json").read_text())
GOLDEN = ARTIFACT["runs"]


def tolerances(golden_machine: dict, current_machine: dict) -> tuple[float, float]:
    """Exact (up to CSV printing) on the machine type that wrote the artifact; the cross-machine bounds
    elsewhere (CI and new sessions may land on another processor)."""
    if golden_machine == current_machine:
        return RELATIVE_TOLERANCE, 1e-12
    return CROSS_MACHINE_RELATIVE, CROSS_MACHINE_ABSOLUTE


@pytest.mark.parametrize("run", sorted(GOLDEN))
def test_short_run_logs_the_golden_metrics(run, current_runs):
    rel, abs_tol = tolerances(ARTIFACT["machine"], current_runs["machine"])
    problems = mismatches({run: GOLDEN[run]}, current_runs["runs"], rel=rel, abs_tol=abs_tol)
    where = ("same machine type as the artifact: exact" if rel == RELATIVE_TOLERANCE else
             f"artifact written on {ARTIFACT['machine']}, running on {current_runs['machine']}: "
             f"cross-machine tolerance rel {rel}, abs {abs_tol}")
    assert not problems, "\n".join(problems[:20]) + f"\n({where})" + _how_to_regenerate()


def test_tolerance_is_exact_on_the_artifacts_machine_and_bounded_elsewhere():
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "isa": "AVX512", "torch": "2.14.1+cu130"}
    amd = dict(intel, cpu="AMD EPYC", isa="AVX2")
    assert tolerances(intel, dict(intel)) == (1e-6, 1e-12)
    assert tolerances(intel, amd) == (1e-3, 1e-4)
    golden = {"a/x": {"0": {"kl": 3.981e-06, "loss": 1.0}}}
    # the measured cross-machine drift passes there, a formula-sized change does not
    drifted = {"a/x": {"0": {"kl": 4.125e-06, "loss": 1.0 + 3.6e-5}}}
    assert mismatches(golden, drifted, *tolerances(intel, amd)) == []
    assert mismatches(golden, drifted, *tolerances(intel, intel)) != []
    assert mismatches(golden, {"a/x": {"0": {"kl": 3.981e-06, "loss": 1.01}}}, *tolerances(intel, amd)) != []


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
