"""TGPO on the STL point mass: STL satisfaction rate over training, MH vs uniform time allocation vs flat PPO on the
terminal robustness reward, over seeds.

Each run is ``TGPOModule`` (mmpo/robotics/tgpo.py) on ``stl_pointmass{K}`` with the settings of
configs/robotics/tgpo_pointmass.yaml (16 envs, one episode per env per iteration), evaluated every ``--eval-every``
iterations on 16 episodes (the allocation of each chosen as the best of 16 by the critic V(s0, tau)). Writes one
JSON (curves per run: iteration, env steps, eval success rate = fraction of episodes with STL robustness > 0) and
a plot of the mean over seeds with a 95% t-interval.

    OMP_NUM_THREADS=1 python bench/bench_tgpo_pointmass.py --iterations 100 --seeds 0 1 2 --out bench/records/tgpo/run

Resumable per run: each finished (variant, seed) run is written at once to ``<out>.runs/<variant>_seed<S>.json``
(with the commit and the UTC times it ran at) and skipped when the same command is run again, so a stop loses
only the run in progress; runs go seed by seed (every variant of a seed, then the next seed). ``<out>.json`` (the
runs of the command) and ``<out>.png`` are derived from the per-run files and written (again) when every run of
the command is there, so a later command with more seeds extends them.
``--task`` takes any STL task (``stl_pointmass{2,3,4}``, ``stl_reacher{2,3,4}``).

    python bench/bench_tgpo_pointmass.py summary --out bench/records/tgpo/by_subgoals A.json B.json ...

plots the final evaluation satisfaction rate against the number of subgoals (mean and 95% t-interval over seeds)
for every (variant, temperature) in the given result files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


VARIANTS = {"mh": ("", "mh"), "uniform": ("", "uniform"), "flat": ("_robustness", "uniform")}
"""variant -> (task suffix, allocation sampler); "flat" is PPO on the terminal STL robustness reward (the allocation
in its observation is drawn uniformly and takes no part in its reward)."""


def run(task: str, variant: str, seed: int, iterations: int, eval_every: int, temperature: float = 1.0) -> dict:
    import lightning.pytorch as pl
    import torch

    from mmpo.robotics.envs.tasks import get_task
    from mmpo.robotics.tgpo import TGPOModule

    suffix, sampler = VARIANTS[variant]
    task = task + suffix
    torch.manual_seed(seed)
    horizon = get_task(task).max_episode_steps
    module = TGPOModule(num_iterations=iterations, env={"task": task, "num_envs": 16, "n_steps": horizon,
                                                        "act_steps": 1, "asynchronous": False},
                        tgpo={"hidden_dims": [64, 64, 64], "sampler": sampler, "temperature": temperature},
                        optim={"minibatch_size": 16 * horizon // 2}, evaluation={"every": eval_every, "episodes": 16},
                        seed=seed)
    curve: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            m = pl_module.last_metrics
            if "eval/success_rate" in m:
                curve.append({"iteration": pl_module.iteration, "env_steps": m["perf/env_steps_total"],
                              "eval_success_rate": m["eval/success_rate"], "eval_return": m["eval/return"],
                              "train_success_rate": m["charts/success_rate"],
                              "mh_accept_rate": pl_module.allocation_metrics.get("tgpo/mh_accept_rate", float("nan"))})

    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         accelerator="cpu", callbacks=[Record()])
    start = time.time()
    trainer.fit(module)
    return {"task": task, "variant": variant, "sampler": sampler, "temperature": temperature, "seed": seed,
            "iterations": iterations, "curve": curve, "seconds": time.time() - start}


def t_interval(values: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    n = len(values)
    if n < 2:
        return float(values.mean()), float("nan")
    return float(values.mean()), float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n))


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty else "")


def run_name(variant: str, seed: int, temperature: float) -> str:
    tag = f"_T{temperature:g}" if variant == "mh" and temperature != 1.0 else ""  # T only acts on MH
    return f"{variant}{tag}_seed{seed}"


def run_all(args: argparse.Namespace) -> None:
    from datetime import datetime, timezone

    from mmpo.files import atomic_write_json

    json_path, png_path = (args.out.parent / f"{args.out.name}.{ext}" for ext in ("json", "png"))
    run_dir = args.out.parent / f"{args.out.name}.runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = {"task": args.task, "iterations": args.iterations, "eval_every": args.eval_every}
    commit = _commit()  # at the start: the code this process imports (later edits of the clone do not reach it)
    runs = []
    for seed in args.seeds:  # seed-major: a stopped command leaves every variant with the same seeds
        for variant in args.variants:
            path = run_dir / f"{run_name(variant, seed, args.temperature)}.json"
            if path.exists():
                result = _load_json(path)
                if any(str(result["settings"][k]) != str(v) for k, v in settings.items()):
                    raise SystemExit(f"{path} was run with {result['settings']}, not {settings}; choose another --out")
                print(f"{path.name}: done before, kept", flush=True)
            else:
                began = datetime.now(timezone.utc).isoformat(timespec="seconds")
                result = run(args.task, variant, seed, args.iterations, args.eval_every, args.temperature)
                result.update(settings=settings, commit=commit, began_utc=began,
                              ended_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"))
                atomic_write_json(path, result)
                last = result["curve"][-1]["eval_success_rate"] if result["curve"] else float("nan")
                print(f"{path.name}: final eval success {last:.3f} ({result['seconds']:.0f} s)", flush=True)
            runs.append(result)
    atomic_write_json(json_path, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    plot_curves(runs, args.task, png_path)


def _load_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def variant_label(run: dict) -> str:
    labels = {"mh": "TGPO, tau by critic-guided MH", "uniform": "TGPO, tau uniform",
              "flat": "PPO, terminal robustness"}
    variant = run.get("variant", run["sampler"])
    temperature = float(run.get("temperature", 1.0))
    return labels[variant] + (f" (T = {temperature:g})" if variant == "mh" and temperature != 1.0 else "")


def plot_curves(runs: list[dict], task: str, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(variant_label(r) for r in runs):
        curves = [r["curve"] for r in runs if variant_label(r) == label]
        steps = [p["env_steps"] for p in curves[0]]
        rates = np.array([[p["eval_success_rate"] for p in c] for c in curves])
        stats = [t_interval(rates[:, i]) for i in range(rates.shape[1])]
        mean = np.array([s[0] for s in stats])
        half = np.nan_to_num(np.array([s[1] for s in stats]))
        ax.plot(steps, mean, label=f"{label} ({len(curves)} seeds)")
        ax.fill_between(steps, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1), alpha=0.2)
        print(label, "final eval success rate: %.3f +- %.3f" % stats[-1], "per seed:", rates[:, -1].tolist())
    ax.set_xlabel("env steps")
    ax.set_ylabel("eval STL satisfaction rate")
    ax.set_title(f"{task}: mean and 95% t-interval over seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def summarise(files: list[Path], out: Path) -> None:
    """Final eval satisfaction rate by number of subgoals (the digit after the system's name), per variant: mean and
    95% t-interval over seeds (also of the mean of the last two evaluations), the paired-by-seed differences between
    the variants at each K, and a plot of the finals."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path = out.parent / f"{out.name}.png"
    if png_path.exists():
        raise SystemExit(f"{png_path} exists; choose another --out")
    rows: dict[str, dict[int, dict[int, tuple[float, float]]]] = {}  # label -> K -> seed -> (final, last two)
    for path in files:
        for r in _load_json(path)["runs"]:
            match = re.match(r"stl_[a-z]+(\d+)", r["task"])
            if match is None:
                raise SystemExit(f"{path}: task {r['task']!r} names no number of subgoals")
            rates = [p["eval_success_rate"] for p in r["curve"]]
            rows.setdefault(variant_label(r), {}).setdefault(int(match.group(1)), {})[int(r["seed"])] = (
                rates[-1], float(np.mean(rates[-2:])))
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, by_k) in enumerate(rows.items()):
        ks = sorted(by_k)
        stats = [t_interval(np.array([v[0] for v in by_k[k].values()])) for k in ks]
        offset = 0.06 * (i - (len(rows) - 1) / 2)
        ax.errorbar([k + offset for k in ks], [s[0] for s in stats], yerr=[np.nan_to_num(s[1]) for s in stats],
                    marker="o", capsize=3, label=label)
        for k, s in zip(ks, stats):
            last_two = t_interval(np.array([v[1] for v in by_k[k].values()]))
            print(f"{label}, K = {k}: final {s[0]:.3f} +- {s[1]:.3f}, mean of the last two evaluations "
                  f"{last_two[0]:.3f} +- {last_two[1]:.3f} over {len(by_k[k])} seeds; per seed (final) "
                  f"{[v[0] for v in by_k[k].values()]}")
    labels = list(rows)
    for a_i, a in enumerate(labels):
        for b in labels[a_i + 1:]:
            for k in sorted(set(rows[a]) & set(rows[b])):
                seeds = sorted(set(rows[a][k]) & set(rows[b][k]))
                if len(seeds) < 2:
                    continue
                for j, what in enumerate(("final", "last two")):
                    diff = t_interval(np.array([rows[a][k][s][j] - rows[b][k][s][j] for s in seeds]))
                    print(f"K = {k}, {what}: [{a}] - [{b}] = {diff[0]:+.3f} +- {diff[1]:.3f} "
                          f"(paired over seeds {seeds})")
    ax.set_xlabel("number of sequential subgoals K")
    ax.set_ylabel("final eval STL satisfaction rate")
    ax.set_xticks(sorted({k for by_k in rows.values() for k in by_k}))
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("mean and 95% t-interval over seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def main() -> None:
    import sys

    if sys.argv[1:2] == ["summary"]:
        parser = argparse.ArgumentParser(description="final satisfaction rate by number of subgoals")
        parser.add_argument("--out", type=Path, required=True, help="output prefix (.png is added)")
        parser.add_argument("files", nargs="+", type=Path, help="result JSONs written by this script")
        args = parser.parse_args(sys.argv[2:])
        summarise(args.files, args.out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="stl_pointmass2")
    parser.add_argument("--variants", nargs="+", default=["mh", "uniform"], choices=sorted(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=1.0, help="MH temperature T (tgpo.temperature)")
    parser.add_argument("--out", type=Path, required=True,
                        help="output prefix (.json, .png and the per-run folder .runs are added)")
    run_all(parser.parse_args())


if __name__ == "__main__":
    main()
