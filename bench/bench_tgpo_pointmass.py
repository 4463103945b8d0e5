"""TGPO on the STL point mass: STL satisfaction rate over training, MH vs uniform time allocation vs flat PPO on the
terminal robustness reward, over seeds.

Each run is ``TGPOModule`` (mmpo/robotics/tgpo.py) on ``stl_pointmass{K}`` with the settings of
configs/robotics/tgpo_pointmass.yaml (16 envs, one episode per env per iteration), evaluated every ``--eval-every``
iterations on 16 episodes (the allocation of each chosen as the best of 16 by the critic V(s0, tau)). Writes one
JSON (curves per run: iteration, env steps, eval success rate = fraction of episodes with STL robustness > 0) and
a plot of the mean over seeds with a 95% t-interval.

    OMP_NUM_THREADS=1 python bench/bench_tgpo_pointmass.py --iterations 100 --seeds 0 1 2 --out bench/records/tgpo
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
    return {"task": task, "variant": variant, "sampler": sampler, "seed": seed, "curve": curve,
            "seconds": time.time() - start}


def t_interval(values: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    n = len(values)
    if n < 2:
        return float(values.mean()), float("nan")
    return float(values.mean()), float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="stl_pointmass2")
    parser.add_argument("--variants", nargs="+", default=["mh", "uniform"], choices=sorted(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=1.0, help="MH temperature T (tgpo.temperature)")
    parser.add_argument("--out", type=Path, required=True, help="output prefix (.json and .png are added)")
    args = parser.parse_args()
    from mmpo.files import atomic_write_json

    json_path, png_path = (args.out.parent / f"{args.out.name}.{ext}" for ext in ("json", "png"))
    for path in (json_path, png_path):
        if path.exists():
            raise SystemExit(f"{path} exists; choose another --out")
    runs = [run(args.task, variant, seed, args.iterations, args.eval_every, args.temperature)
            for variant in args.variants for seed in args.seeds]
    atomic_write_json(json_path, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"mh": "TGPO, tau by critic-guided MH", "uniform": "TGPO, tau uniform", "flat": "PPO, terminal robustness"}
    for variant in args.variants:
        curves = [r["curve"] for r in runs if r.get("variant", r["sampler"]) == variant]
        steps = [p["env_steps"] for p in curves[0]]
        rates = np.array([[p["eval_success_rate"] for p in c] for c in curves])
        stats = [t_interval(rates[:, i]) for i in range(rates.shape[1])]
        mean = np.array([s[0] for s in stats])
        half = np.nan_to_num(np.array([s[1] for s in stats]))
        ax.plot(steps, mean, label=f"{labels[variant]} ({len(curves)} seeds)")
        ax.fill_between(steps, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1), alpha=0.2)
        print(variant, "final eval success rate: %.3f +- %.3f" % stats[-1], "per seed:", rates[:, -1].tolist())
    ax.set_xlabel("env steps")
    ax.set_ylabel("eval STL satisfaction rate")
    ax.set_title(f"{args.task}: mean and 95% t-interval over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    main()
