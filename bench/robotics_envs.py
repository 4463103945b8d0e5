"""Benchmark of the robotics env side: scripted-expert success vs noise, and env steps/s.

Usage:
    python bench/robotics_envs.py experts --task lift --episodes 50 --noises 0 0.1 0.2 0.3 0.5
    python bench/robotics_envs.py throughput --task lift --num-envs 2 --steps 400

Prints one JSON line per measurement (copy them into bench/RESULTS.md (section robotics_envs)).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def experts(args: argparse.Namespace) -> None:
    from mmpo.robotics.demos import generate_demos

    for noise in args.noises:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            stats = generate_demos(
                args.task,
                args.episodes,
                os.path.join(tmp, "demos.hdf5"),
                noise=noise,
                seed=args.seed,
                keep_failures=True,  # every attempt is written, so success_rate = successes / episodes
                store_model_file=False,
                progress=False,
            )
        stats["seconds"] = time.perf_counter() - start
        stats.pop("path"), stats.pop("stats_path")
        print(json.dumps({"task": args.task, "seed": args.seed, **stats}), flush=True)


def throughput(args: argparse.Namespace) -> None:
    from mmpo.robotics.envs import measure_steps_per_s

    result = measure_steps_per_s(args.task, args.num_envs, args.steps, act_steps=args.act_steps, seed=args.seed)
    print(json.dumps({"task": args.task, **result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_exp = sub.add_parser("experts")
    p_exp.add_argument("--task", default="lift")
    p_exp.add_argument("--episodes", type=int, default=50)
    p_exp.add_argument("--noises", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5])
    p_exp.add_argument("--seed", type=int, default=0)
    p_exp.set_defaults(run=experts)
    p_thr = sub.add_parser("throughput")
    p_thr.add_argument("--task", default="lift")
    p_thr.add_argument("--num-envs", type=int, default=2)
    p_thr.add_argument("--steps", type=int, default=400)
    p_thr.add_argument("--act-steps", type=int, default=4)
    p_thr.add_argument("--seed", type=int, default=0)
    p_thr.set_defaults(run=throughput)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
