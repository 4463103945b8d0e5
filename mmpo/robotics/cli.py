"""Command-line programs of the robotics package.

``mmpo demos`` (here) writes scripted demonstrations; ``mmpo rollout`` lives in
``mmpo/robotics/rollout_cli.py`` (policy side) and is re-exported so ``mmpo.cli`` finds both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from mmpo.robotics.rollout_cli import rollout_main  # noqa: F401  (re-export for `mmpo rollout`)


def _demos_parser() -> argparse.ArgumentParser:
    from mmpo.robotics.envs.tasks import expert_tasks

    parser = argparse.ArgumentParser(
        prog="mmpo demos",
        description="Generate scripted-expert demonstrations (robosuite Lift/Can, or any registered task "
        "with an expert) in robomimic's HDF5 layout, plus min-max normaliser stats beside them (<out>.stats.json).",
    )
    parser.add_argument("--task", required=True, choices=expert_tasks(),
                        help="a registered task with a scripted expert (mmpo.robotics.envs.register_task)")
    parser.add_argument("--num-demos", type=int, required=True, help="demos to write (successful ones)")
    parser.add_argument("--noise", type=float, default=0.0, help="std of Gaussian noise on expert actions (default 0: the clean expert; "
                        "0.3-0.5 gives imperfect demos, a BC start that DPPO can improve on)")
    parser.add_argument("--out", required=True, help="output .hdf5 path")
    parser.add_argument("--seed", type=int, default=0, help="seed for layouts and noise")
    parser.add_argument("--max-steps", type=int, default=None, help="episode cap (default: task limit, 300)")
    parser.add_argument("--keep-failures", action="store_true", help="also write failed attempts")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file and its stats (they are replaced only once the new "
                        "ones are complete)")
    return parser


def demos_main(argv: Sequence[str] | None = None) -> int:
    """``mmpo demos --task lift --num-demos N --noise X --out PATH [--seed S] [--max-steps M]``."""
    args = _demos_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.num_demos < 1:
        print(f"error: --num-demos must be >= 1, got {args.num_demos}", file=sys.stderr)
        return 2
    if args.noise < 0:
        print(f"error: --noise must be >= 0, got {args.noise}", file=sys.stderr)
        return 2
    existing = [path for path in (args.out, f"{args.out}.stats.json") if os.path.exists(path)]
    if existing and not args.overwrite:
        print(f"error: {' and '.join(existing)} already exist; pass --overwrite to replace them "
              "(or choose another --out)", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mmpo.robotics.demos import generate_demos

    stats = generate_demos(
        args.task,
        args.num_demos,
        args.out,
        noise=args.noise,
        seed=args.seed,
        max_steps=args.max_steps,
        keep_failures=args.keep_failures,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    print(
        f"{args.task}: expert success rate {stats['success_rate']:.3f} "
        f"({stats['successes']}/{stats['attempts']} attempts, noise={args.noise}); "
        f"wrote {stats['num_demos']} demos, {stats['total_samples']} samples"
    )
    print(f"demos: {stats['path']}")
    print(f"normaliser stats: {stats['stats_path']}")
    print(json.dumps(stats))
    return 0 if stats["num_demos"] == args.num_demos else 1
