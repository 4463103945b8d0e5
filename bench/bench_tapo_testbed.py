"""TAPO vs GRPO from a weak start on the TAPO testbed (docs/prompt_space.md, "TAPO testbed"): held-out accuracy and
the share of all-wrong groups, over seeds.

Stages (each resumable: a finished piece is a file and is not redone):

1. ``start``: the weak start (``mmpo.algos.tapo_testbed.build_weak_start``, seed 0) under OUT/runs/tapo_testbed,
   then its template library with ``mmpo tapo-library`` on ``--seed-problems`` training-split problems (the search
   over the reasoning actions scored by the weak start; nothing is assigned by hand), and the start's held-out
   scores: unguided, and guided by the template retrieved for each problem.
2. per seed S and algorithm: ``mmpo fit`` of configs/llm/tapo_testbed_tiny.yaml (TAPO) or
   tapo_testbed_grpo_tiny.yaml (GRPO) from the same weak start, seeded by S (data order, sampling), then held-out
   scores of the exported policy, unguided (the prompt at test time has no template): greedy accuracy and
   sampled accuracy (avg@4, temperature 1), per item, on the same ``--heldout`` test-split items for every run.
   OUT/results/{algo}_s{S}.json.
3. report: per seed, TAPO - GRPO paired by item (mmpo.eval.stats.paired_difference: hierarchical bootstrap over
   seeds and items, and Student-t over the seeds), each against the start, and the all-wrong group share
   (``tapo/all_wrong_group_frac``, groups whose every reward is <= 0, guided rollouts included for TAPO) in the
   first and last fifth of the steps. Printed as Markdown; OUT/summary.json.

    OMP_NUM_THREADS=1 python bench/bench_tapo_testbed.py --out OUT --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"tapo": "tapo_testbed_tiny.yaml", "grpo": "tapo_testbed_grpo_tiny.yaml"}
ALGOS = ("grpo", "tapo")
TESTBED = Path("runs") / "tapo_testbed"


def run(command: list[str], cwd: Path, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as handle:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}); see {log}")


def heldout_rows(n: int) -> list[dict]:
    from mmpo.data.synthetic import make_items

    return make_items("strategy_mix", n, seed=0, split="test")


def score(model_path: Path, rows: list[dict], library: dict | None = None) -> dict:
    """Per-item greedy correctness and avg@4 at temperature 1; with ``library``, each prompt carries its retrieved
    template (the guided form)."""
    from mmpo.algos.tapo import guided_problem, retrieve
    from mmpo.eval.heldout import heldout_texts, sampled_accuracy
    from mmpo.rewards import accuracy_reward
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(model_path)
    prompts = [{**row, "problem": guided_problem(row["problem"], retrieve(library, row["problem"])[0])}
               if library else row for row in rows]
    greedy = [float(s > 0.5) for s in accuracy_reward(heldout_texts(model, processor, prompts, max_new_tokens=10),
                                                        rows).tolist()]
    sampled = sampled_accuracy(model, processor, prompts, samples=4, temperature=1.0, max_new_tokens=10)
    # sampled_accuracy scores against the prompt rows' answers: the guided rows keep each row's answer
    return {"greedy": greedy, "sampled": sampled, "family": [row["difficulty"] for row in rows]}


def start_stage(out: Path, args: argparse.Namespace) -> dict:
    from mmpo.algos.tapo_testbed import build_weak_start
    from mmpo.files import atomic_write_json

    testbed = out / TESTBED
    done = out / "results" / "start.json"
    if done.exists():
        return json.loads(done.read_text())
    started = time.time()
    if not (testbed / "weak_start" / "config.json").exists():
        build_weak_start(testbed, seed=0, steps=args.sft_steps, explore=args.explore)
    library_path = testbed / "library.json"
    if not library_path.exists():
        run([sys.executable, "-m", "mmpo.cli", "tapo-library", "--model", str(testbed / "weak_start"),
             "--tasks", "strategy_mix", "--size", str(args.seed_problems), "--samples", str(args.search_samples),
             "--max-depth", "3", "--beam", "2", "--max-new-tokens", "10", "--temperature", "1.0", "--seed", "0",
             "--out", str(library_path)], out, out / "library.log")
    library = json.loads(library_path.read_text())
    rows = heldout_rows(args.heldout)
    result = {"library": library, "unguided": score(testbed / "weak_start", rows),
              "guided": score(testbed / "weak_start", rows, library), "seconds": round(time.time() - started, 1)}
    atomic_write_json(done, result)
    return result


def all_wrong_fractions(metrics_csv: Path) -> list[float]:
    return logged(metrics_csv, "tapo/all_wrong_group_frac")


def logged(metrics_csv: Path, key: str) -> list[float]:
    """The per-step values of ``key`` in a run's metrics.csv (steps that logged it)."""
    return [float(row[key]) for row in csv.DictReader(metrics_csv.open()) if row.get(key)]


#: training-curve metrics reported first -> last fifth (the TAPO ones for TAPO only)
CURVES = ("rewards/total/mean", "tapo/guided_reward_mean", "tapo/unguided_reward_mean",
          "tapo/unguided_all_wrong_group_frac")


def seed_stage(out: Path, algo: str, seed: int, args: argparse.Namespace) -> dict:
    from mmpo.files import atomic_write_json

    done = out / "results" / f"{algo}_s{seed}.json"
    if done.exists():
        return json.loads(done.read_text())
    started = time.time()
    name = f"{algo}_s{seed}"
    logs = TESTBED / f"{name}_logs"
    run([sys.executable, "-m", "mmpo.cli", "fit", "-c", str(ROOT / "configs" / "llm" / CONFIGS[algo]),
         f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--model.init_args.seed={seed}",
         f"--trainer.max_steps={args.steps}", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={logs}", f"--trainer.logger.init_args.save_dir={logs}",
         f"--model.init_args.output_dir={TESTBED / name}", f"--model.init_args.optim.lr={args.lr}"],
        out, out / f"{name}.log")
    (metrics,) = (out / logs).glob("**/metrics.csv")
    result = {"algo": algo, "seed": seed, "steps": args.steps, "lr": args.lr,
              "all_wrong": all_wrong_fractions(metrics), **score(out / TESTBED / name, heldout_rows(args.heldout)),
              "seconds": round(time.time() - started, 1)}
    atomic_write_json(done, result)
    return result


def fifth(values: list[float], last: bool) -> float:
    k = max(1, len(values) // 5)
    part = values[-k:] if last else values[:k]
    return sum(part) / len(part)


def curves(out: Path, runs: dict[str, list[dict]]) -> dict:
    """Per algorithm and curve metric, the first and last fifth of the steps, mean over seeds."""
    found: dict = {}
    for algo, results in runs.items():
        for key in CURVES:
            series = [logged(next((out / TESTBED / f"{algo}_s{r['seed']}_logs").glob("**/metrics.csv")), key)
                      for r in results]
            if all(series):
                found.setdefault(algo, {})[key] = {
                    "first": sum(fifth(v, False) for v in series) / len(series),
                    "last": sum(fifth(v, True) for v in series) / len(series)}
    return found


def summarize(start: dict, runs: dict[str, list[dict]]) -> dict:
    from mmpo.eval.stats import paired_difference, seed_t_interval

    def mean(values):
        return sum(values) / len(values)

    summary: dict = {"start": {form: {kind: mean(start[form][kind]) for kind in ("greedy", "sampled")}
                               for form in ("unguided", "guided")},
                     "library": [(t["complexity"], t["actions"], round(t["value"], 3), t["count"])
                                 for t in start["library"]["templates"]],
                     "seeds": [r["seed"] for r in runs["tapo"]]}
    for kind in ("greedy", "sampled"):
        per_algo = {algo: [r[kind] for r in runs[algo]] for algo in ALGOS}
        summary[kind] = {
            "per_seed": {algo: [mean(v) for v in per_algo[algo]] for algo in ALGOS},
            "tapo_minus_grpo": paired_difference(per_algo["tapo"], per_algo["grpo"]),
            **{f"{algo}_minus_start": paired_difference(per_algo[algo], [start["unguided"][kind]] * len(per_algo[algo]))
               for algo in ALGOS},
            "by_family": {algo: {f: mean([mean([c for c, fam in zip(r[kind], r["family"]) if fam == f])
                                          for r in runs[algo]]) for f in (1, 2, 3)} for algo in ALGOS},
        }
    frac = {algo: {"first": [fifth(r["all_wrong"], False) for r in runs[algo]],
                   "last": [fifth(r["all_wrong"], True) for r in runs[algo]],
                   "all": [mean(r["all_wrong"]) for r in runs[algo]]} for algo in ALGOS}
    diff = [t - g for t, g in zip(frac["tapo"]["all"], frac["grpo"]["all"])]
    summary["all_wrong"] = {**frac, "tapo_minus_grpo_all": {"estimate": mean(diff), "per_seed": diff,
                                                            "seed_t": seed_t_interval(diff)}}
    last = [t - g for t, g in zip(frac["tapo"]["last"], frac["grpo"]["last"])]
    summary["all_wrong"]["tapo_minus_grpo_last"] = {"estimate": mean(last), "per_seed": last,
                                                    "seed_t": seed_t_interval(last)}
    return summary


def table(summary: dict) -> str:
    from mmpo.eval.stats import format_interval

    seeds = summary["seeds"]
    lines = ["| seed | " + " | ".join(str(s) for s in seeds) + " | mean |", "|---" * (len(seeds) + 2) + "|"]
    for kind in ("greedy", "sampled"):
        for algo in ALGOS:
            values = summary[kind]["per_seed"][algo]
            lines.append(f"| {algo.upper()} held-out {kind} | " + " | ".join(f"{v:.3f}" for v in values)
                         + f" | {sum(values) / len(values):.3f} |")
        diff = summary[kind]["tapo_minus_grpo"]
        lines.append(f"| TAPO - GRPO ({kind}) | " + " | ".join(f"{v:+.3f}" for v in diff["per_seed"])
                     + f" | {diff['estimate']:+.3f} |")
    for algo in ALGOS:
        values = summary["all_wrong"][algo]["all"]
        lines.append(f"| {algo.upper()} all-wrong groups (all steps) | " + " | ".join(f"{v:.3f}" for v in values)
                     + f" | {sum(values) / len(values):.3f} |")
    lines.append("")
    for kind in ("greedy", "sampled"):
        for key in ("tapo_minus_grpo", "grpo_minus_start", "tapo_minus_start"):
            d = summary[kind][key]
            lines.append(f"- {kind} {key}: {d['estimate']:+.3f}, bootstrap {format_interval(d['bootstrap'])}, "
                         f"seed-t {format_interval(d['seed_t'])}")
        lines.append(f"- {kind} by family (1: 4 values largest, 2: 5 smallest, 3: 6 last): "
                     + "; ".join(f"{a} " + ", ".join(f"{v:.3f}" for v in summary[kind]["by_family"][a].values())
                                 for a in ALGOS))
    aw = summary["all_wrong"]
    lines.append("- all-wrong groups first -> last fifth: " + "; ".join(
        f"{a} {sum(aw[a]['first']) / len(aw[a]['first']):.3f} -> {sum(aw[a]['last']) / len(aw[a]['last']):.3f}"
        for a in ALGOS) + f"; TAPO - GRPO over all steps {aw['tapo_minus_grpo_all']['estimate']:+.3f}, seed-t "
        f"{format_interval(aw['tapo_minus_grpo_all']['seed_t'])}, in the last fifth "
        f"{aw['tapo_minus_grpo_last']['estimate']:+.3f}, seed-t {format_interval(aw['tapo_minus_grpo_last']['seed_t'])}")
    for algo, found in summary.get("curves", {}).items():
        lines.append(f"- {algo} training, first -> last fifth: " + "; ".join(
            f"{key} {v['first']:.3f} -> {v['last']:.3f}" for key, v in found.items()))
    start = summary["start"]
    lines.append(f"- start: unguided greedy {start['unguided']['greedy']:.3f}, sampled {start['unguided']['sampled']:.3f}; "
                 f"guided by the retrieved template greedy {start['guided']['greedy']:.3f}, sampled "
                 f"{start['guided']['sampled']:.3f}; library (complexity, actions, value, count): {summary['library']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (finished pieces are not redone)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--algos", default="grpo,tapo", help="comma-separated: grpo, tapo")
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--sft-steps", type=int, default=600, help="weak-start fine-tuning steps")
    parser.add_argument("--explore", type=float, default=0.15,
                        help="the weak start's unguided share of uniformly drawn procedures (build_weak_start)")
    parser.add_argument("--seed-problems", type=int, default=12, help="training-split seed problems for the library")
    parser.add_argument("--search-samples", type=int, default=4, help="completions per scored node")
    parser.add_argument("--heldout", type=int, default=150, help="test-split items (families cycle)")
    parser.add_argument("--no-report", action="store_true", help="run the stages only")
    args = parser.parse_args()
    from mmpo.files import atomic_write_json

    out = Path(args.out).resolve()
    (out / "results").mkdir(parents=True, exist_ok=True)
    start = start_stage(out, args)
    print(f"start: {json.dumps({k: v for k, v in start.items() if k != 'library'} | {'library': start['library']['templates']})[:600]}",
          flush=True)
    runs: dict[str, list[dict]] = {algo: [] for algo in ALGOS}
    for seed in args.seeds:
        for algo in args.algos.split(","):
            result = seed_stage(out, algo, seed, args)
            runs[algo].append(result)
            print(f"{algo} seed {seed}: greedy {sum(result['greedy']) / len(result['greedy']):.3f}, sampled "
                  f"{sum(result['sampled']) / len(result['sampled']):.3f}, all-wrong "
                  f"{sum(result['all_wrong']) / len(result['all_wrong']):.3f} ({result['seconds']} s)", flush=True)
    if args.no_report or not all(runs[a] for a in ALGOS):
        return
    summary = summarize(start, runs)
    summary["curves"] = curves(out, runs)
    atomic_write_json(out / "summary.json", summary)
    print(table(summary))


if __name__ == "__main__":
    main()
