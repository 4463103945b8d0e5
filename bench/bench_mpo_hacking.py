"""The MPO hacking testbed, fixed rubric vs MPO over seeds (issue 40's evidence; docs/rewards.md, "MPO").

Runs ``configs/vlm/mpo_hacking_tiny.yaml`` from ``--sft`` once per (arm, seed), one run at a time: "fixed" with
``mpo_interval=100000`` (the first rubric is never rewritten), "mpo" with the config's interval. The proxy is the
judge reward (``rewards/judge/mean``, the rubric's items passed), the oracle ``mpo/oracle_mean`` (accuracy, never
trained on). Change = mean of the last ``--window`` batches minus mean of the first ``--window``; reported as the
mean over seeds with a 95 % Student-t interval (``mmpo.eval.stats.seed_t_interval``), and the paired MPO - fixed
difference per seed. Writes ``summary.json`` (atomically) and a markdown table under ``--out``.

    python bench/bench_mpo_hacking.py --sft runs/tiny/sft_hacking --out runs/mpo_hacking_bench --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "vlm" / "mpo_hacking_tiny.yaml"
ARMS = {"fixed": ["--model.init_args.mpo_interval=100000"], "mpo": []}


def run(arm: str, seed: int, sft: str, out: Path) -> Path:
    """Train one (arm, seed) run under ``out/<arm>_s<seed>`` (skipped when its metrics exist); its metrics.csv."""
    directory = out / f"{arm}_s{seed}"
    found = sorted(directory.glob("**/metrics.csv"))
    if found and (directory / "done").exists():
        return found[-1]
    command = [sys.executable, "-m", "mmpo.cli", "fit", "-c", str(CONFIG), f"--seed_everything={seed}",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={directory}",
               f"--trainer.logger.init_args.save_dir={directory}",
               f"--trainer.callbacks.init_args.dirpath={directory / 'ckpt'}",
               f"--model.init_args.model_path={sft}", f"--model.init_args.output_dir={directory / 'hf'}",
               f"--model.init_args.mpo_rubric_dir={directory / 'rubrics'}", f"--model.init_args.seed={seed}",
               f"--data.init_args.seed={seed}", *ARMS[arm]]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "log.txt", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    (directory / "done").write_text("")
    return sorted(directory.glob("**/metrics.csv"))[-1]


def changes(metrics: Path, window: int) -> dict[str, float]:
    """First-``window`` and last-``window`` batch means of the proxy and the oracle, and their changes."""
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("rewards/judge/mean")]
    result: dict[str, float] = {"batches": float(len(rows))}
    for name, key in (("proxy", "rewards/judge/mean"), ("oracle", "mpo/oracle_mean")):
        values = [float(row[key]) for row in rows]
        result[f"{name}_first"], result[f"{name}_last"] = mean(values[:window]), mean(values[-window:])
        result[f"{name}_change"] = result[f"{name}_last"] - result[f"{name}_first"]
    result["rubric_iterations"] = float(rows[-1]["mpo/rubric_iteration"])
    return result


def summarize(results: dict[str, dict[int, dict[str, float]]], seeds: list[int]) -> dict:
    """Per arm the mean change of the proxy and the oracle with its seed-t 95 % interval, and the paired
    MPO - fixed differences per seed (``results[arm][seed]`` as :func:`changes` gives)."""
    from mmpo.eval.stats import seed_t_interval

    summary: dict = {"seeds": list(seeds), "runs": results}
    for arm in ARMS:
        for name in ("proxy", "oracle"):
            values = [results[arm][s][f"{name}_change"] for s in seeds]
            summary[f"{arm}_{name}_change"] = {"per_seed": values, "mean": mean(values),
                                               "ci95": list(seed_t_interval(values))}
    for name in ("proxy", "oracle"):
        diffs = [results["mpo"][s][f"{name}_change"] - results["fixed"][s][f"{name}_change"] for s in seeds]
        summary[f"paired_{name}_mpo_minus_fixed"] = {"per_seed": diffs, "mean": mean(diffs),
                                                     "ci95": list(seed_t_interval(diffs))}
    return summary


def table(summary: dict) -> str:
    """The markdown table of :func:`summarize`'s summary and the paired differences under it."""
    from mmpo.eval.stats import format_interval

    seeds = summary["seeds"]
    lines = ["| run | proxy change | oracle change | per-seed proxy, first -> last | per-seed oracle, first -> last |",
             "|---|---|---|---|---|"]
    for arm in ARMS:
        per = [summary["runs"][arm][s] for s in seeds]
        changes_ = [summary[f"{arm}_{n}_change"] for n in ("proxy", "oracle")]
        row = [arm] + [f"{c['mean']:+.3f} {format_interval(c['ci95'])}" for c in changes_]
        row += [", ".join(f"{r[f'{n}_first']:.3f}->{r[f'{n}_last']:.3f}" for r in per) for n in ("proxy", "oracle")]
        lines.append("| " + " | ".join(row) + " |")
    for name in ("proxy", "oracle"):
        paired = summary[f"paired_{name}_mpo_minus_fixed"]
        lines.append(f"\npaired MPO - fixed, {name} change: {paired['mean']:+.3f} {format_interval(paired['ci95'])}"
                     f" (per seed {', '.join(f'{d:+.3f}' for d in paired['per_seed'])})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from mmpo.files import atomic_write_json, atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT model directory (the config's header builds it)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args(argv)
    results = {arm: {seed: changes(run(arm, seed, args.sft, args.out), args.window) for seed in args.seeds}
               for arm in ARMS}
    summary = {**summarize(results, args.seeds), "window": args.window}
    text = table(summary)
    atomic_write_json(args.out / "summary.json", summary)
    atomic_write_text(args.out / "table.md", text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
