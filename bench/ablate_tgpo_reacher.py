"""Which change makes TGPO learn the STL Reacher task: the obstacle's placement or the reward's distance scale?
Trains one (variant, seed) run of bench/bench_tgpo_pointmass.py on a two-subgoal Reacher task registered here with
a chosen obstacle placement (``REACHER_OBSTACLES`` of mmpo/robotics/envs/stl_envs.py) and ``distance_scale``, and
writes the run (curve, settings) to ``<out>/<name>_<variant>_seed<S>.json``.

    OMP_NUM_THREADS=1 python bench/ablate_tgpo_reacher.py --obstacle inner --distance-scale 1 --out bench/records/tgpo/reacher2_seed0_ablation
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_tgpo_pointmass as bench  # noqa: E402


def register(name: str, obstacle: str, distance_scale: float) -> str:
    """Register ``stl_<name>2`` and its flat baseline ``stl_<name>2_robustness``; returns the task name."""
    import gymnasium as gym

    from mmpo.robotics.envs.tasks import TaskSpec, register_task

    for suffix, reward in (("", "stage"), ("_robustness", "robustness")):
        env_id = f"MmpoAblation{name}{suffix}-v0"
        if env_id not in gym.registry:
            gym.register(env_id, entry_point="mmpo.robotics.envs.stl_envs:STLReacherEnv",
                         kwargs={"num_subgoals": 2, "reward": reward, "obstacle": obstacle,
                                 "distance_scale": distance_scale})
        register_task(TaskSpec(f"stl_{name}2{suffix}", "gymnasium", env_id, ("observation",), 60, 14, 2),
                      replace=True)
    return f"stl_{name}2"


def main() -> None:
    from mmpo.files import atomic_write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--obstacle", required=True, choices=["arc", "inner"])
    parser.add_argument("--distance-scale", type=float, required=True)
    parser.add_argument("--variant", default="mh", choices=sorted(bench.VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args()
    name = f"reacher{args.obstacle}scale{args.distance_scale:g}"
    path = args.out / f"{name}_{args.variant}_seed{args.seed}.json"
    if path.exists():
        raise SystemExit(f"{path} exists; choose another --out")
    commit = bench._commit()
    result = bench.run(register(name, args.obstacle, args.distance_scale), args.variant, args.seed, args.iterations, 10)
    result.update(obstacle=args.obstacle, distance_scale=args.distance_scale, commit=commit)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    print(name, [round(p["eval_success_rate"], 3) for p in result["curve"]], flush=True)


if __name__ == "__main__":
    main()
