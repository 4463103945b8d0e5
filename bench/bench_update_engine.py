"""Side by side: a GRPO fit of configs/vlm/grpo_tiny.yaml before and after the update-engine change.

Each side is a checkout (``--before REV``: a git worktree of that commit; the after side is this checkout),
run as its own ``mmpo fit`` subprocess (``PYTHONPATH`` = that checkout, one thread), interleaved A B B A for
``--rounds`` rounds. Both sides start from the same tiny model, seed and data, so they must end with the
same weights: the script reports the largest difference of the exported weights between the sides (0 = the
refactor changed no number) and each side's wall and CPU seconds (the children's user + system time).

    python bench/bench_update_engine.py --before ce943f4 --steps 6 --rounds 2 --out runs/bench_update_engine
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def worktree(rev: str, where: Path) -> Path:
    """A detached checkout of ``rev`` at ``where`` (reused when it is already that commit)."""
    if where.exists():
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        wanted = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True).stdout
        if head.strip() == wanted.strip():
            return where
        raise SystemExit(f"{where} holds another commit; remove it (git worktree remove {where})")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True)
    return where


def fit_args(tree: Path, model: Path, out: Path, steps: int) -> list[str]:
    """``mmpo fit`` of the side's own grpo_tiny.yaml on ``model``; the group names of the typed configs when
    the side has them, else the flat names (the settings are the config's own either way)."""
    config = tree / "configs" / "vlm" / "grpo_tiny.yaml"
    init = yaml.safe_load(config.read_text())["model"]["init_args"]
    export = "export.output_dir" if isinstance(init.get("export"), dict) else "output_dir"
    return [sys.executable, "-m", "mmpo.cli", "fit", "-c", str(config),
            f"--model.init_args.model_path={model}", f"--model.init_args.{export}={out / 'hf'}",
            f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={out}", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--seed_everything=0"]


def side_env(tree: Path) -> dict[str, str]:
    """The environment of a side's subprocess: its checkout first on the path, one thread; checked to import
    ``mmpo`` from that checkout (not from an installed copy)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import mmpo; print(mmpo.__file__)"], env=env, cwd=tree,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: mmpo imports from {where}, not from the checkout")
    return env


def run_side(tree: Path, model: Path, out: Path, steps: int) -> dict[str, float]:
    env = side_env(tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(fit_args(tree, model, out, steps), cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: mmpo fit failed\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def max_weight_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(file))
        return tensors

    first, second = weights(a), weights(b)
    if sorted(first) != sorted(second):
        raise SystemExit("the two sides exported different parameter names")
    return max(float((first[k].double() - second[k].double()).abs().max()) for k in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit before the change (e.g. ce943f4)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_update_engine"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "mmpo.cli", "build-tiny", "--out", str(model)], check=True, cwd=REPO)
    trees = {"before": worktree(args.before, out / "trees" / "before"), "after": REPO}
    times: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_index in range(args.rounds):  # A B B A
        for side in ("before", "after", "after", "before"):
            run_dir = out / f"{side}_{round_index}_{len(times[side])}"
            times[side].append(run_side(trees[side], model, run_dir, args.steps))
            print(side, times[side][-1], flush=True)
    difference = max_weight_difference(out / "before_0_0" / "hf", out / "after_0_0" / "hf")
    summary = {
        "before": args.before, "steps": args.steps, "rounds": args.rounds, "max_abs_weight_difference": difference,
        **{f"{side}_{key}_median": statistics.median(t[key] for t in runs)
           for side, runs in times.items() for key in ("wall_s", "cpu_s")},
        "runs": times,
    }
    from mmpo.files import atomic_write_json

    atomic_write_json(out / "summary.json", summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
