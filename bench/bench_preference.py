"""Benchmark (issue 17): DPO on the synthetic preference set and online INPO from the same SFT start.

Both run their tiny configs (``configs/vlm/dpo_tiny.yaml``, ``configs/vlm/inpo_tiny.yaml``) through
``mmpo fit`` from one SFT checkpoint, for ``--seeds`` seeds (``seed_everything``, the module's sampling
seed and the data seed, so each seed also draws its own training items and pairs), and every final
policy and the SFT start are scored by greedy held-out accuracy on the tasks' test split (items no
training run sees). Per run: accuracy with a Wilson 95% interval over the items; per method: the
mean over seeds with a t 95% interval (t = 4.30 for 3 seeds).

    python bench/bench_preference.py --sft runs/tiny/sft --seeds 3 --out runs/bench_preference
    python bench/bench_preference.py --methods dpo --override=--model.init_args.optim.lr=1e-5 --out runs/bench_preference_dpo_lr1e-5
    python bench/bench_preference.py --methods inpo --seeds 5 --first-seed 3 --out runs/bench_preference_inpo_confirm

Results: ``--out/results.json`` (rewritten after every run; a rerun skips finished runs) and
``--out/summary.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mmpo.eval.stats import seed_t_interval, wilson_interval  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402

torch.set_num_threads(1)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "vlm"
TASKS = ["count_shapes", "relative_position", "compare_size", "bar_chart", "arithmetic"]
METHODS = {"dpo": "dpo_tiny.yaml", "inpo": "inpo_tiny.yaml"}


def heldout_accuracy(model_path: str, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Greedy accuracy (math-verify ``accuracy`` reward) of the saved policy on ``rows`` (mmpo.eval.heldout)."""
    from mmpo.eval.heldout import checkpoint_heldout_accuracy

    return checkpoint_heldout_accuracy(model_path, rows, max_new_tokens=max_new_tokens)["all"]


def fit(method: str, seed: int, sft: str, out: Path, steps: int, overrides: list[str]) -> str:
    from mmpo.cli import main

    run = out / f"{method}_seed{seed}"
    main(["fit", "-c", str(CONFIGS / METHODS[method]), f"--seed_everything={seed}",
          f"--model.init_args.model_path={sft}", f"--model.init_args.output_dir={run / 'hf'}",
          "--model.init_args.overwrite_output=true", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
          "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
          f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
          f"--data.init_args.seed={seed}", *([f"--model.init_args.seed={seed}"] if method == "inpo" else []),
          *overrides])
    return str(run / "hf")


def summarize(results: dict[str, Any], n_items: int) -> str:
    lines = ["| policy | seed | held-out accuracy | Wilson 95% | train s |", "|---|---|---|---|---|"]
    sft = results["sft"]["accuracy"]
    lo, hi = wilson_interval(sft, n_items)
    lines.append(f"| SFT start | - | {sft:.3f} | [{lo:.3f}, {hi:.3f}] | - |")
    for key, run in sorted(results.items()):
        if key == "sft":
            continue
        lo, hi = wilson_interval(run["accuracy"], n_items)
        lines.append(f"| {run['method']} | {run['seed']} | {run['accuracy']:.3f} | [{lo:.3f}, {hi:.3f}] | {run['seconds']:.0f} |")
    lines += ["", "| method | seeds | mean accuracy | t 95% interval over seeds | mean - SFT |", "|---|---|---|---|---|"]
    for method in METHODS:
        accs = [r["accuracy"] for k, r in results.items() if k != "sft" and r["method"] == method]
        if not accs:
            continue
        mean = statistics.fmean(accs)
        low, high = seed_t_interval(accs)
        lines.append(f"| {method} | {len(accs)} | {mean:.3f} | [{low:.3f}, {high:.3f}] | {mean - sft:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="runs/tiny/sft", help="the SFT checkpoint both methods start from")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed .. first-seed + seeds - 1 (a confirmation run on seeds a sweep did not use)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the tiny configs' 60)")
    parser.add_argument("--eval-per-task", type=int, default=32, help="held-out test items per task")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", default="runs/bench_preference")
    parser.add_argument("--override", action="append", default=[], metavar="--KEY=VALUE",
                        help="an `mmpo fit` override for every run (repeatable), e.g. --override=--model.init_args.optim.lr=1e-5")
    args = parser.parse_args(argv)
    from mmpo.data.synthetic import make_items

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for task in TASKS for row in make_items(task, args.eval_per_task, seed=0, split="test")]
    results_path = out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save() -> None:
        atomic_write_json(results_path, results)
        (out / "summary.md").write_text(summarize(results, len(rows)))

    if "sft" not in results:
        results["sft"] = {"accuracy": heldout_accuracy(args.sft, rows, args.max_new_tokens)}
        save()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for method in args.methods:
            key = f"{method}_seed{seed}"
            if key in results:
                continue
            start = time.perf_counter()
            path = fit(method, seed, args.sft, out, args.steps, args.override)
            seconds = time.perf_counter() - start
            results[key] = {"method": method, "seed": seed, "seconds": seconds,
                            "accuracy": heldout_accuracy(path, rows, args.max_new_tokens)}
            save()
            print(key, results[key], flush=True)
    print(summarize(results, len(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
