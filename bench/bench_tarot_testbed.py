"""TAROT on its testbed: does obfuscation by GRPO / DPO on TAROT's reward make a retrained attacker fail while the
topic stays readable? SFT start vs GRPO vs DPO, over seeds.

Per seed S (everything seeded by S): ``mmpo.rewards.tarot_testbed.build_testbed`` (texts, the two encoders, the
policy's base) under OUT/seed_S/runs/tarot_testbed; ``mmpo fit`` of configs/llm/tarot_testbed_sft.yaml; then
configs/llm/tarot_testbed_grpo.yaml from the SFT model, and the DPO path: two SFT rewrites per RL text at
temperature 1, TAROT's pairs (``dpo_pairs``, official thresholds), configs/llm/tarot_testbed_dpo.yaml. Each policy
(and the untouched texts, "original") is measured by ``evaluate_rewrites`` on greedy rewrites: the attacker
retrained on the rewrites, the static attacker, the topic classifier, the TAROT reward parts. Writes
OUT/seed_S/results.json per seed and OUT/summary.json, and prints a markdown table (mean and 95% seed-t intervals;
differences paired by seed).

    OMP_NUM_THREADS=1 python bench/bench_tarot_testbed.py --seeds 0 1 2 3 4 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("attacker_accuracy", "static_attacker_accuracy", "utility_accuracy", "privacy", "utility", "tics_per_text")


def fit(config: str, cwd: Path, seed: int, steps: int, log: Path) -> None:
    """``mmpo fit`` of a testbed config in ``cwd`` (its relative runs/ paths), seeded, ``steps`` optimizer steps."""
    command = [sys.executable, "-m", "mmpo.cli", "fit", "-c", str(ROOT / "configs" / "llm" / config),
               f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--trainer.max_steps={steps}"]
    if "grpo" in config:
        command.append(f"--model.init_args.seed={seed}")  # the rollout sampling's seed
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as handle:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}); see {log}")


def run_seed(seed: int, out: Path, args: argparse.Namespace) -> dict:
    from mmpo.files import atomic_write_json
    from mmpo.rewards.tarot import dpo_pairs, write_dpo_pairs
    from mmpo.rewards.tarot_testbed import build_testbed, encoders, evaluate_rewrites, read_jsonl, rewrite

    work = out / f"seed_{seed}"
    if (work / "results.json").exists():
        return json.loads((work / "results.json").read_text())
    testbed = work / "runs" / "tarot_testbed"
    started = time.time()
    if not (testbed / "testbed.json").exists():
        build_testbed(testbed, seed=seed)
    info = json.loads((testbed / "testbed.json").read_text())
    fit("tarot_testbed_sft.yaml", work, seed, args.sft_steps, work / "sft.log")
    fit("tarot_testbed_grpo.yaml", work, seed, args.grpo_steps, work / "grpo.log")
    sources = [row["problem"] for row in read_jsonl(testbed / "rl.jsonl")]
    samples = rewrite(testbed / "sft", sources, num_samples=2, temperature=1.0, seed=seed)
    style, semantic = encoders(testbed)
    pairs = dpo_pairs(sources, [s[0] for s in samples], [s[1] for s in samples], style=style, semantic=semantic)
    write_dpo_pairs(str(testbed / "dpo_pairs.jsonl"), pairs, overwrite=True)
    fit("tarot_testbed_dpo.yaml", work, seed, args.dpo_steps, work / "dpo.log")

    attack = [row["text"] for row in read_jsonl(testbed / "attack_train.jsonl")]
    heldout = [row["text"] for row in read_jsonl(testbed / "heldout.jsonl")]
    results = {"seed": seed, "testbed": info, "dpo_pairs": len(pairs), "steps": {
        "sft": args.sft_steps, "grpo": args.grpo_steps, "dpo": args.dpo_steps}, "policies": {}, "examples": {}}
    results["policies"]["original"] = evaluate_rewrites(testbed, attack, heldout, seed=seed)
    for name in ("sft", "grpo", "dpo"):
        attack_out = [r[0] for r in rewrite(testbed / name, attack)]
        heldout_out = [r[0] for r in rewrite(testbed / name, heldout)]
        results["policies"][name] = evaluate_rewrites(testbed, attack_out, heldout_out, seed=seed)
        results["examples"][name] = [[source, rewritten] for source, rewritten in zip(heldout[:5], heldout_out[:5])]
    results["seconds"] = round(time.time() - started, 1)
    atomic_write_json(work / "results.json", results)
    return results


def summarize(per_seed: list[dict]) -> dict:
    import numpy as np

    from mmpo.eval.stats import seed_t_interval

    summary: dict = {"seeds": [r["seed"] for r in per_seed], "policies": {}, "vs_sft": {}}
    for name in ("original", "sft", "grpo", "dpo"):
        summary["policies"][name] = {}
        for metric in METRICS:
            values = [r["policies"][name][metric] for r in per_seed]
            summary["policies"][name][metric] = {"mean": float(np.mean(values)), "per_seed": values,
                                                 "seed_t": seed_t_interval(values)}
    for name in ("grpo", "dpo"):
        summary["vs_sft"][name] = {}
        for metric in METRICS:
            values = [r["policies"][name][metric] - r["policies"]["sft"][metric] for r in per_seed]
            summary["vs_sft"][name][metric] = {"mean": float(np.mean(values)), "per_seed": values,
                                               "seed_t": seed_t_interval(values)}
    return summary


def table(summary: dict) -> str:
    from mmpo.eval.stats import format_interval

    lines = ["| policy | attacker acc. (retrained) | static attacker acc. | utility (topic) acc. | TAROT privacy | "
             "TAROT utility | tics per text |", "|---|---|---|---|---|---|---|"]
    for name, label in (("original", "original texts"), ("sft", "SFT start"), ("grpo", "TAROT-GRPO"),
                        ("dpo", "TAROT-DPO")):
        cells = []
        for metric in METRICS:
            entry = summary["policies"][name][metric]
            cells.append(f"{entry['mean']:.3f} {format_interval(entry['seed_t']).replace('+', '')}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, label in (("grpo", "GRPO - SFT"), ("dpo", "DPO - SFT")):
        cells = [f"{summary['vs_sft'][name][m]['mean']:+.3f} {format_interval(summary['vs_sft'][name][m]['seed_t'])}"
                 for m in METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", required=True, help="output folder (a seed with results.json is not rerun)")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--dpo-steps", type=int, default=60)
    args = parser.parse_args()
    from mmpo.files import atomic_write_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_seed = []
    for seed in args.seeds:
        result = run_seed(seed, out, args)
        per_seed.append(result)
        print(f"seed {seed}: " + ", ".join(f"{name} attacker {p['attacker_accuracy']:.3f} utility "
                                          f"{p['utility_accuracy']:.3f}" for name, p in result["policies"].items()),
              flush=True)
    summary = summarize(per_seed)
    atomic_write_json(out / "summary.json", summary)
    print(table(summary))


if __name__ == "__main__":
    main()
