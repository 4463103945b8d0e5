"""Side by side: the cost of a training step of DVPO, PPO with a learned critic, and GRPO on the tiny VLM.

Each side is its own subprocess (this script with ``--worker NAME``, one thread) that builds the module exactly as
``bench/bench_vlm_algos.py`` does (``make_module``: same settings, seed and data), trains ``--steps`` steps from
the same SFT start and writes what it measured; the sides run interleaved A B C C B A for ``--rounds`` rounds,
so a change in the machine's load falls on every side alike. Measured per run:

- time per step: wall (``perf_counter``) and CPU (``process_time``) seconds of every step (rollout, rewards,
  values, update); the first step (warm-up) is left out of the medians;
- memory: the process's peak RSS (``VmHWM``) and its RSS before the module was built (the interpreter and
  libraries); and the counted bytes, the deterministic part: the parameters of every model the step holds (policy,
  KL reference, value model), the gradients of the trainable ones, and the optimizer state after the steps;
- the machine's load average at the start and end of the run (the machine may be shared).

    python bench/bench_vlm_algos.py --out runs/bench_dvpo --algos grpo,ppo,dvpo ...   # SFT start + value model
    python bench/bench_dvpo_cost.py --from runs/bench_dvpo --steps 5 --rounds 3 --out runs/bench_dvpo_cost

``--from``: a ``bench_vlm_algos.py`` output directory holding ``sft/hf`` and ``dvpo_value/hf``. Results go to
``--out`` (``results.json``, updated after every run; ``summary.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SIDES = ("grpo", "ppo", "dvpo")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def counted_bytes(module: Any) -> dict[str, int]:
    """Parameters of every model the step holds, gradients of the trainable ones, optimizer state (bytes)."""
    import torch

    reference = getattr(module, "reference_model", None)
    value_model = getattr(module, "value_model", None)
    params = {"policy": _bytes(module.model.parameters()),
              "reference": _bytes(reference.parameters()) if reference is not None else 0,
              "value_model": _bytes(value_model.parameters()) if value_model is not None else 0}
    optimizer = module.optimizers()
    optimizer = getattr(optimizer, "optimizer", optimizer)
    state = _bytes(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    trainable = _bytes(p for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
    return {**{f"params_{k}": v for k, v in params.items()}, "gradients": trainable, "optimizer_state": state,
            "total": sum(params.values()) + trainable + state}


def worker(args: argparse.Namespace) -> None:
    """One side: ``args.steps`` steps of ``args.worker``; its measurements as JSON to ``args.json``."""
    import importlib.util

    load_start = os.getloadavg()
    # the accuracy bench's module builder, loaded from its file (the bench scripts are not a package); it sets
    # one thread
    spec = importlib.util.spec_from_file_location("bench_vlm_algos", REPO / "bench" / "bench_vlm_algos.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_vlm_algos"] = bench
    spec.loader.exec_module(bench)
    import lightning as L

    from mmpo.data.datamodule import PromptDataModule
    from mmpo.files import atomic_write_json

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.wall.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])

    rss_before = _status_kib("VmRSS") * 1024
    source = Path(args.source)
    module = bench.make_module(args.worker, args.seed, {"sft": source / "sft" / "hf",
                                                        "dvpo_value": source / "dvpo_value" / "hf"}, args)
    data = PromptDataModule(tasks=bench.TASKS, train_size=args.rl_train_size, val_size=0, seed=args.seed,
                            batch_size=args.prompts_per_step)
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, datamodule=data)
    atomic_write_json(Path(args.json), {
        "algo": args.worker, "wall_s": timer.wall, "cpu_s": timer.cpu, "rss_before_module_bytes": rss_before,
        "peak_rss_bytes": _status_kib("VmHWM") * 1024, "counted_bytes": counted_bytes(module),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "completion_length": float(module.last_metrics.get("response/length_mean", float("nan"))),
    })


def run_side(name: str, run_json: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--json", str(run_json),
               "--from", str(args.source), *_shared_args(args)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the worker failed\n{done.stderr[-3000:]}")
    return json.loads(run_json.read_text())


SHARED = {"steps": 5, "seed": 0, "group_size": 4, "max_new_tokens": 48, "prompts_per_step": 4, "rl_lr": 1e-4,
          "rl_train_size": 240}


def _shared_args(args: argparse.Namespace) -> list[str]:
    return [item for key in SHARED for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def summarize(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    per: dict[str, dict[str, Any]] = {}
    for name in SIDES:
        mine = [r for r in runs if r["algo"] == name]
        if not mine:
            continue
        run_walls = [statistics.median(r["wall_s"][1:]) for r in mine]  # each run's median step, warm-up left out
        run_cpus = [statistics.median(r["cpu_s"][1:]) for r in mine]
        per[name] = {"runs": len(mine), "step_wall_s_median": statistics.median(run_walls),
                     "step_wall_s_runs": run_walls, "step_cpu_s_median": statistics.median(run_cpus),
                     "step_cpu_s_runs": run_cpus,
                     "peak_rss_mib_median": statistics.median(r["peak_rss_bytes"] for r in mine) / 2**20,
                     "rss_before_module_mib_median": statistics.median(r["rss_before_module_bytes"] for r in mine) / 2**20,
                     "counted_bytes": mine[0]["counted_bytes"],
                     "completion_length_mean": statistics.mean(r["completion_length"] for r in mine)}
    loads = [x for r in runs for x in (r["loadavg_start"][0], r["loadavg_end"][0])]
    lines = ["| | GRPO | PPO + critic | DVPO | DVPO / PPO | DVPO / GRPO |", "|---|---|---|---|---|---|"]

    def row(label: str, get, fmt: str) -> None:
        if not all(s in per for s in SIDES):
            return
        values = [get(per[s]) for s in SIDES]
        lines.append(f"| {label} | " + " | ".join(format(v, fmt) for v in values)
                     + f" | {values[2] / values[1]:.2f} | {values[2] / values[0]:.2f} |")

    row("step wall s (median of run medians)", lambda p: p["step_wall_s_median"], ".2f")
    row("step CPU s (median of run medians)", lambda p: p["step_cpu_s_median"], ".2f")
    row("peak RSS MiB (median)", lambda p: p["peak_rss_mib_median"], ".0f")
    row("peak RSS - RSS before the module, MiB", lambda p: p["peak_rss_mib_median"] - p["rss_before_module_mib_median"], ".0f")
    for key in ("params_policy", "params_reference", "params_value_model", "gradients", "optimizer_state", "total"):
        if all(s in per for s in SIDES) and all(per[s]["counted_bytes"][key] for s in SIDES):
            row(f"counted {key.replace('_', ' ')} MiB", lambda p, k=key: p["counted_bytes"][k] / 2**20, ".1f")
        elif all(s in per for s in SIDES):
            lines.append(f"| counted {key.replace('_', ' ')} MiB | " + " | ".join(
                f"{per[s]['counted_bytes'][key] / 2**20:.1f}" for s in SIDES) + " | - | - |")
    if loads:
        lines.append("")
        lines.append(f"1-minute load average over the runs: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
                     f"max {max(loads):.1f} ({os.cpu_count()} CPUs).")
    return {"sides": per, "loadavg_1min": loads}, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", type=Path, default=Path("runs/bench_dvpo"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench_dvpo_cost"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    for key, value in SHARED.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.source = args.source.resolve()
    for needed in (args.source / "sft" / "hf", args.source / "dvpo_value" / "hf"):
        if not (needed / "config.json").is_file():
            raise SystemExit(f"{needed} is missing: run bench/bench_vlm_algos.py --algos dvpo --out {args.source} first")
    from mmpo.files import atomic_write_json

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for round_index in range(args.rounds):  # A B C C B A
        for position, name in enumerate((*SIDES, *reversed(SIDES))):
            result = run_side(name, out / f"run_{round_index}_{position}_{name}.json", args)
            state["runs"].append({**result, "round": round_index, "position": position})
            atomic_write_json(out / "results.json", state)
            print(f"[cost] round {round_index} {name}: step wall {statistics.median(result['wall_s'][1:]):.2f} s, "
                  f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB, load {result['loadavg_end'][0]:.1f}",
                  flush=True)
    state["summary"], table = summarize(state["runs"])
    atomic_write_json(out / "results.json", state)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
