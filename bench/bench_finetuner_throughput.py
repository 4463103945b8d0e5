"""Benchmark: rollout-collection env steps/s of each fine-tuner (DPPO, ReinFlow, FPO, DSRL, DSRL-NA) vs the raw simulator.

Every side plays the same vector env on robosuite ``--task`` (default Lift, state observations): ``--num-envs``
subprocess envs (``asynchronous``, one group, a seeded reset of every env at each rollout's start, final autoreset
skipped: the configs' env settings), ``--n-steps`` chunk steps of ``act_steps`` = 4 actions per env per rollout:

- ``raw``: the vector env stepping uniformly random action chunks (no policy), reset included;
- ``dppo`` / ``reinflow`` / ``fpo`` / ``dsrl`` / ``dsrl_na``: ``collect_rollout`` of the module its config
  ``configs/robotics/<method>_lift.yaml`` builds (its ``init_args`` with only ``env``, ``evaluation`` and
  ``bc_checkpoint`` replaced), on a randomly initialised BC policy of the BC config's architecture
  (``bc_lift.yaml``: the K = 20 DDPM diffusion MLP [512] x 3; ``flow_bc_lift.yaml``: the K = 4 flow MLP [512] x 3).
  Throughput does not depend on what the policy learned. DSRL's collection is measured after its warm-up
  (``warmup_chunk_steps`` 0: the noise actor, MLP 2048 x 3 with LayerNorm, picks the noise), with a small replay
  buffer (the rollout does not touch it). DSRL-NA's rollout differs only in what it stores (the chunk) and in
  its noise box ([-1, 1]).

Each side runs in its own subprocess with one thread (OMP/MKL 1, ``torch.set_num_threads(1)``); its env workers
are started and ``--warmup`` rollouts are played untimed, then ``--rollouts`` rollouts are timed: wall seconds,
and CPU seconds of the subprocess and all its descendants (the env workers; from /proc). Sides are interleaved
ABBA over rounds (round 0 in order, round 1 reversed, ...). Printed: per round and side, env steps/s (wall) and
CPU-ms per env step; then a table of the means over rounds and their ratio to raw (per-round paired ratios).

    OMP_NUM_THREADS=1 python bench/bench_finetuner_throughput.py --rounds 3 --num-envs 2 --n-steps 25
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench scripts this one reuses

import bench_dppo_throughput as dppo_bench  # noqa: E402  (sets OMP/MKL to 1 thread)
from bench_grpo_vs_trl import _cpu_s_of, _single_thread  # noqa: E402

from mmpo.files import atomic_write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "robotics"
#: method -> (its fine-tuning config, the BC config whose architecture it starts from)
METHODS: dict[str, tuple[str, str]] = {
    "dppo": ("dppo_lift.yaml", "bc_lift.yaml"),
    "reinflow": ("reinflow_lift.yaml", "flow_bc_lift.yaml"),
    "fpo": ("fpo_lift.yaml", "flow_bc_lift.yaml"),
    "dsrl": ("dsrl_lift.yaml", "flow_bc_lift.yaml"),
    "dsrl_na": ("dsrl_na_lift.yaml", "flow_bc_lift.yaml"),
}
SIDES = ("raw", *METHODS)
TINY_WIDTH = 32  # --tiny: every hidden width (smoke tests)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="lift")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES),
                        help="what to measure, in this order in even rounds (raw: the simulator alone)")
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds, >= 1")
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--n-steps", type=int, default=25, help="chunk steps per env per rollout")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rollouts per subprocess")
    parser.add_argument("--rollouts", type=int, default=1, help="timed rollouts per subprocess, >= 1")
    parser.add_argument("--tiny", action="store_true", help=f"hidden widths {TINY_WIDTH} (smoke tests, not timings)")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    parser.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "num_envs", "n_steps", "rollouts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def round_order(sides: list[str], round_: int) -> list[str]:
    """ABBA over rounds: the sides in order in even rounds, reversed in odd ones."""
    return list(sides) if round_ % 2 == 0 else list(reversed(sides))


# ----------------------------------------------------------------------------- building the sides


def model_init_args(config: str) -> tuple[str, dict]:
    """(class_path, init_args) of ``configs/robotics/<config>``'s model."""
    import yaml

    model = yaml.safe_load((CONFIGS / config).read_text())["model"]
    return model["class_path"], dict(model.get("init_args") or {})


def _class(path: str):
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def save_bc_checkpoint(config: str, path: Path, tiny: bool = False, seed: int = 0) -> Path:
    """A randomly initialised BC policy of ``config``'s architecture (``tiny``: widths 32), saved as a checkpoint
    the fine-tuners load (the policy's weights and its robotics metadata)."""
    import torch

    class_path, init_args = model_init_args(config)
    if tiny:
        init_args["hidden_dims"] = [TINY_WIDTH, TINY_WIDTH]
    torch.manual_seed(seed)
    bc = _class(class_path)(**init_args, export_safetensors=False)
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, path)
    return path


def env_settings(args: argparse.Namespace) -> dict:
    """The one vector-env setting of every side (the configs' own, but ``num_envs`` and ``n_steps``)."""
    return dict(num_envs=args.num_envs, n_steps=args.n_steps, asynchronous=True, reset_at_iteration=True,
                env_groups=1, prefetch_reset=False, skip_final_autoreset=True)


def build_collector(method: str, bc_checkpoint: str, args: argparse.Namespace):
    """The fine-tuning module of ``method``'s config on ``bc_checkpoint``, with the bench's env, no evaluation; DSRL
    past its warm-up with a small buffer (``--tiny``: its MLPs 32 wide)."""
    class_path, init_args = model_init_args(METHODS[method][0])
    init_args.update(bc_checkpoint=str(bc_checkpoint), env=env_settings(args), evaluation={"every": 0})
    if "dsrl" in init_args:
        dsrl = dict(init_args["dsrl"], warmup_chunk_steps=0, buffer_size=max(1, args.num_envs * args.n_steps))
        if args.tiny:
            dsrl["hidden_dims"] = [TINY_WIDTH, TINY_WIDTH]
        init_args["dsrl"] = dsrl
    return _class(class_path)(**init_args)


class RawCollector:
    """The raw side: the same vector env as the modules' (``make_vector_env`` with the BC checkpoint's task, act_steps
    and episode length), each rollout a seeded reset of every env (final autoreset skipped) then ``n_steps`` uniformly
    random action chunks. ``collect_rollout`` / ``train_tracker.env_steps`` / ``env`` as the modules', so
    :func:`bench_dppo_throughput.timed_collection` times it as it times them."""

    def __init__(self, reference, seed: int = 0) -> None:
        from types import SimpleNamespace

        self.env, self.iteration, self.seed = reference.env, 0, seed
        self.task, self.act_steps, self.max_episode_steps = reference.task, reference.act_steps, reference.max_episode_steps
        self.train_tracker = SimpleNamespace(env_steps=0)
        self.envs = None

    def make_envs(self):
        from mmpo.robotics.envs import make_vector_env

        envs = make_vector_env(self.task, self.env.num_envs, seed=self.seed, act_steps=self.act_steps,
                               max_episode_steps=self.max_episode_steps, asynchronous=self.env.asynchronous)
        envs.action_space.seed(self.seed)
        return envs

    def collect_rollout(self) -> None:
        from mmpo.robotics.envs.chunking import SKIP_AUTORESET_AFTER

        self.envs.reset(seed=self.seed + 1000 * self.iteration, options={SKIP_AUTORESET_AFTER: self.env.n_steps})
        for _ in range(self.env.n_steps):
            self.envs.step(self.envs.action_space.sample())
        self.train_tracker.env_steps += self.env.num_envs * self.env.n_steps * self.act_steps


def descendant_pids(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, grandchildren: the forkserver's env workers), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def tree_cpu_s(pid: int | None = None) -> float:
    """utime + stime of ``pid`` (this process) and its live descendants."""
    pid = os.getpid() if pid is None else pid
    return sum(_cpu_s_of(p) for p in [pid, *descendant_pids(pid)])


def run_side(side: str, checkpoints: dict[str, str], args: argparse.Namespace) -> dict:
    """Build ``side``, start its env workers, play ``--warmup`` untimed and ``--rollouts`` timed rollouts."""
    _single_thread()
    method = "dppo" if side == "raw" else side
    collector = build_collector(method, checkpoints[METHODS[method][1]], args)
    if side == "raw":
        collector = RawCollector(collector)
    collector.envs = collector.make_envs()
    try:
        timed = []
        for index in range(args.warmup + args.rollouts):
            collector.iteration = index
            result = dppo_bench.timed_collection(collector, cpu_s=tree_cpu_s)
            if index >= args.warmup:
                timed.append(result)
    finally:
        collector.envs.close()
    return {key: sum(t[key] for t in timed) for key in ("env_steps", "wall_s", "cpu_s")}


# ----------------------------------------------------------------------------- summary


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per side over rounds: mean / min / max env steps/s (wall), mean CPU-ms per env step, and against raw (when
    measured): the ratio of the mean rates, the median of the per-round ratios (round r against raw's round r) and
    the ratio of CPU-ms per env step."""
    table: dict[str, dict[str, float]] = {}
    for side, results in runs.items():
        rates = [r["env_steps"] / r["wall_s"] for r in results]
        cpu_ms = [1000 * r["cpu_s"] / r["env_steps"] for r in results]
        table[side] = {"steps_per_s": statistics.mean(rates), "min": min(rates), "max": max(rates),
                       "cpu_ms_per_step": statistics.mean(cpu_ms)}
    if "raw" in runs:
        raw_rates = [r["env_steps"] / r["wall_s"] for r in runs["raw"]]
        for side, results in runs.items():
            rates = [r["env_steps"] / r["wall_s"] for r in results]
            table[side]["x_raw"] = table[side]["steps_per_s"] / table["raw"]["steps_per_s"]
            table[side]["x_raw_paired_median"] = statistics.median(a / b for a, b in zip(rates, raw_rates))
            table[side]["cpu_x_raw"] = table[side]["cpu_ms_per_step"] / table["raw"]["cpu_ms_per_step"]
    return table


def format_table(table: dict[str, dict[str, float]]) -> str:
    with_raw = all("x_raw" in row for row in table.values())
    head = "| side | env steps/s (mean) | min | max | CPU-ms / env step |"
    rule = "|---|---|---|---|---|"
    if with_raw:
        head += " x raw (wall) | x raw (paired median) | CPU x raw |"
        rule += "---|---|---|"
    lines = [head, rule]
    for side, row in table.items():
        line = (f"| {side} | {row['steps_per_s']:.1f} | {row['min']:.1f} | {row['max']:.1f} | "
                f"{row['cpu_ms_per_step']:.2f} |")
        if with_raw:
            line += f" {row['x_raw']:.2f} | {row['x_raw_paired_median']:.2f} | {row['cpu_x_raw']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--task", args.task, "--num-envs", str(args.num_envs), "--n-steps", str(args.n_steps),
             "--warmup", str(args.warmup), "--rollouts", str(args.rollouts)]
    return flags + (["--tiny"] if args.tiny else [])


def _spawn(side: str, checkpoints: dict[str, str], args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        done = subprocess.run([sys.executable, __file__, "--worker", side, "--checkpoints", json.dumps(checkpoints),
                               "--out", str(out), *_forwarded(args)], env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{side} run failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        atomic_write_json(args.out, run_side(args.worker, json.loads(args.checkpoints), args), indent=None)
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    print(f"- start {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; commit {commit}; load average "
          f"{os.getloadavg()}; {os.cpu_count()} CPUs; {platform.processor() or platform.machine()}", flush=True)
    print(f"- settings: { {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ('worker', 'checkpoints', 'out')} }",
          flush=True)
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    with tempfile.TemporaryDirectory() as tmp:
        needed = {METHODS["dppo" if side == "raw" else side][1] for side in args.sides}
        checkpoints = {config: str(save_bc_checkpoint(config, Path(tmp) / f"{config}.ckpt", tiny=args.tiny))
                       for config in sorted(needed)}
        for round_ in range(args.rounds):
            for side in round_order(args.sides, round_):
                result = _spawn(side, checkpoints, args)
                runs[side].append(result)
                print(f"round {round_} {side:8s}: {result['env_steps'] / result['wall_s']:.1f} env steps/s wall, "
                      f"{1000 * result['cpu_s'] / result['env_steps']:.2f} CPU-ms / env step ({result['env_steps']:.0f} "
                      f"env steps, {result['wall_s']:.2f} s, {result['cpu_s']:.2f} CPU-s); load {os.getloadavg()[0]:.2f}",
                      flush=True)
    print(f"- end {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average {os.getloadavg()}\n")
    table = summarise(runs)
    print(format_table(table))
    if args.json:
        atomic_write_json(args.json, {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                      "commit": commit, "runs": runs, "summary": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
