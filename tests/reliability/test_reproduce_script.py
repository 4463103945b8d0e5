"""bench/reproduce.py's reading of bench/RESULTS.md, of fresh outputs, and its comparison: on a fake
RESULTS snippet and fake outputs with knowable statuses (no benchmark runs here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_reproduce", REPO / "bench" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


reproduce = _load()

FAKE_RESULTS = """# Benchmark results

<a id="quickstart"></a>

## Quickstart

### Reference table (2026-12-05, commit 21ceec3, SIMD level pinned): a reference table

Some words.

| task | before SFT | after SFT | after GRPO |
| --- | --- | --- | --- |
| count_shapes | 0.000 | 0.260 | 0.370 |
| mean | 0.000 | **0.273** | 0.337 |

Stage times (s): ...

| task | before SFT | after SFT | after GRPO |
| --- | --- | --- | --- |
| mean | 9.000 | 9.000 | 9.000 |

<a id="dllm"></a>

### The tiny configs end to end: reference (22:12-22:21 UTC)

| model | `mmpo eval` mmpo/dllm/arith (256 held-out, greedy) | all-wrong groups after replacement |
|---|---|---|
| SFT (`sft_tiny.yaml`) | 0.199 | |
| GRPO (`grpo_tiny.yaml`) | 0.246 | 0.358 |
| IGPO (`igpo_tiny.yaml`) | 0.266 | 0.068 |

<a id="robotics-envs"></a>

### Env steps per second: raw simulator vs subprocess vector env (Lift)

| num_envs | raw steps/s | vector env steps/s (all envs) | vector / raw | raw CPU s per step |
|---|---|---|---|---|
| 1 | 40.9 | 39.9 | 0.98 | 0.0068 |
| 4 | 41.5 | 47.6 | 1.15 | 0.0068 |
"""


def test_recorded_numbers_come_from_the_first_table_of_the_named_section():
    claims = {claim.name: claim.recorded for claim in reproduce.quickstart_recorded(FAKE_RESULTS)}
    assert claims == {"quickstart count_shapes before SFT": 0.0, "quickstart count_shapes after SFT": 0.26,
                      "quickstart count_shapes after GRPO": 0.37, "quickstart mean before SFT": 0.0,
                      "quickstart mean after SFT": 0.273, "quickstart mean after GRPO": 0.337}
    assert [(c.name, c.recorded) for c in reproduce.dllm_recorded(FAKE_RESULTS)] == [
        ("dllm SFT eval mmpo/dllm/arith accuracy", 0.199), ("dllm GRPO eval mmpo/dllm/arith accuracy", 0.246),
        ("dllm IGPO eval mmpo/dllm/arith accuracy", 0.266)]
    env = reproduce.throughput_recorded(FAKE_RESULTS)
    assert [(c.name, c.recorded, c.rel_tol) for c in env] == [
        ("env lift num_envs=1 raw CPU s per step", 0.0068, 0.3),
        ("env lift num_envs=4 raw CPU s per step", 0.0068, 0.3)]


def test_a_missing_section_is_a_clear_error():
    with pytest.raises(KeyError, match="core"):
        reproduce.core_recorded(FAKE_RESULTS)


FAKE_CORE = """<a id="core"></a>

#### CPU (the target configuration)

| phase | path | peak RSS over inputs (MiB) | time (ms) | memory ratio naive/chunked | time ratio |
|---|---|---|---|---|---|
| fwd | naive | 4763 | 58581.5 | | |
| fwd | chunked | 319 | 65767.2 | 14.9x | 1.12x |

results equal (log-probs, grad hidden, grad lm_head rows): yes

#### GPU

results equal (log-probs, grad hidden, grad lm_head rows): NO
"""


def test_core_claims_memory_within_5_percent_and_the_cpu_agreement(tmp_path):
    memory = reproduce.core_recorded(FAKE_CORE)
    assert [(c.name, c.recorded, c.rel_tol) for c in memory] == [
        ("core fwd naive peak MiB", 4763.0, 0.05), ("core fwd chunked peak MiB", 319.0, 0.05),
        ("core fwd memory ratio naive/chunked", 14.9, 0.05)]
    cpu_table = FAKE_CORE.split("#### CPU (the target configuration)")[1]
    (tmp_path / "core_table.md").write_text("V=151936, H=896, B=4, T=1024, float32 on cpu" + cpu_table
                                            .replace("| 319 |", "| 350 |").replace("14.9x", "13.6x"))
    statuses = [row[3] for row in reproduce.compare(memory, reproduce.core_measured(tmp_path, ""))]
    assert statuses == ["ok (+-5%)", "DIFFERS (+-5%)", "DIFFERS (+-5%)"]  # 350 is +9.7%, 13.6 is -8.7%
    (agreement,) = reproduce.core_agreement_recorded(FAKE_CORE)  # the CPU section's "yes", not the GPU's
    assert agreement.recorded == 1.0
    assert reproduce.core_agreement_measured(tmp_path, "...\n" + reproduce.AGREEMENT + " NO\n") == {agreement.name: 0.0}
    assert reproduce.compare([agreement], {agreement.name: 0.0})[0][3] == "DIFFERS"


def test_fresh_numbers_are_read_from_the_runs_outputs(tmp_path):
    (tmp_path / "quickstart").mkdir()
    (tmp_path / "quickstart" / "quickstart.json").write_text(json.dumps({"accuracy": {
        "before SFT": {"count_shapes": 0.0, "mean": 0.0}, "after SFT": {"count_shapes": 0.26, "mean": 0.2733333},
        "after GRPO": {"count_shapes": 0.36, "mean": 0.3366667}}}))
    now = reproduce.quickstart_measured(tmp_path, "")
    assert now["quickstart mean after GRPO"] == 0.3366667 and now["quickstart count_shapes after GRPO"] == 0.36
    stdout = "noise\n" + json.dumps({"task": "lift", "raw_steps_per_s": 40.0, "raw_cpu_s_per_step": 0.0071,
                                     "num_envs": 4.0}) + "\n"
    assert reproduce.throughput_measured(tmp_path, stdout) == {"env lift num_envs=4 raw CPU s per step": 0.0071}
    (tmp_path / "eval_grpo_tiny").mkdir()
    results = {"benchmarks": {"mmpo/dllm/arith": {"accuracy": 0.238}}}
    (tmp_path / "eval_grpo_tiny" / "results.json").write_text(json.dumps(results))
    assert reproduce.dllm_measured(tmp_path, "") == {"dllm GRPO eval mmpo/dllm/arith accuracy": 0.238}


def test_statuses_exact_to_the_printed_precision_or_within_the_tolerance():
    claims = reproduce.quickstart_recorded(FAKE_RESULTS) + reproduce.throughput_recorded(FAKE_RESULTS)
    now = {"quickstart count_shapes before SFT": 0.0, "quickstart count_shapes after SFT": 0.26,
           "quickstart count_shapes after GRPO": 0.36,  # the recorded 0.370 no longer comes out
           "quickstart mean before SFT": 0.0, "quickstart mean after SFT": 0.2733333,  # rounds to 0.273: ok
           # "quickstart mean after GRPO" not produced (the run failed)
           "env lift num_envs=1 raw CPU s per step": 0.0085,  # +25%: within 30%
           "env lift num_envs=4 raw CPU s per step": 0.0095}  # +40%
    rows = reproduce.compare(claims, now)
    assert [(name, status) for name, _, _, status in rows] == [
        ("quickstart count_shapes before SFT", "ok"), ("quickstart count_shapes after SFT", "ok"),
        ("quickstart count_shapes after GRPO", "DIFFERS"), ("quickstart mean before SFT", "ok"),
        ("quickstart mean after SFT", "ok"), ("quickstart mean after GRPO", "MISSING"),
        ("env lift num_envs=1 raw CPU s per step", "ok (+-30%)"),
        ("env lift num_envs=4 raw CPU s per step", "DIFFERS (+-30%)")]
    assert rows[2][1:3] == ("0.370", "0.360") and rows[5][2] == "n/a"
    table = reproduce.format_table(rows).splitlines()
    assert table[0].split(" | ")[0].strip() == "claim" and len(table) == len(rows) + 2
    assert "0.370" in table[4] and "DIFFERS" in table[4]


def test_list_states_every_items_duration_and_command(capsys):
    assert reproduce.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for item in reproduce.ITEMS:
        assert f"{item.name}" in listing and item.minutes in listing
    assert "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1" in listing and "quickstart --out DIR/quickstart" in listing
    assert "dllm_tiny (slow: needs --slow)" in listing


def test_the_real_record_parses_for_every_item():
    text = (REPO / "bench" / "RESULTS.md").read_text()
    for item in reproduce.ITEMS:
        claims = item.recorded(text)
        assert claims and all(claim.recorded is not None for claim in claims), item.name


def test_grpo_vs_trl_ratio_read_from_results_and_from_the_benchmarks_json(tmp_path):
    fake = """<a id="grpo-vs-trl"></a>

## GRPO step time vs TRL

| 32 tokens | mmpo | TRL | mmpo / TRL |
|---|---|---|---|
| s / step (wall) | 0.129 | 0.211 | **0.61x** |
| CPU-s / step | 0.128 | 0.210 | **0.61x** |

| 128 tokens | mmpo | TRL | mmpo / TRL |
|---|---|---|---|
| s / step (wall) | 0.436 | 0.544 | **0.80x** |
"""
    claims = reproduce.trl_recorded(fake)
    assert [(c.name, c.recorded, c.rel_tol) for c in claims] == [
        ("GRPO step mmpo / TRL wall at 32 tokens", 0.61, 0.15), ("GRPO step mmpo / TRL wall at 128 tokens", 0.80, 0.15)]
    runs = {"32": {"mmpo": [{"wall_s": 0.2}, {"wall_s": 0.1}, {"wall_s": 0.3}],
                   "trl": [{"wall_s": 0.4}, {"wall_s": 0.4}, {"wall_s": 0.5}]},
            "128": {"mmpo": [{"wall_s": 0.9}], "trl": [{"wall_s": 1.0}]}}
    (tmp_path / "grpo_vs_trl.json").write_text(json.dumps({"runs": runs}))
    now = reproduce.trl_measured(tmp_path, "")
    assert now == {"GRPO step mmpo / TRL wall at 32 tokens": pytest.approx(0.5),  # median 0.2 / median 0.4
                   "GRPO step mmpo / TRL wall at 128 tokens": pytest.approx(0.9)}
    assert [row[3] for row in reproduce.compare(claims, now)] == ["DIFFERS (+-15%)", "ok (+-15%)"]
