"""Per-step logging cost of a tiny GRPO step: mmpo's path against every key through ``self.log``.

Each measurement is a fresh subprocess (one thread) running ``--steps`` GRPO steps of a tiny Qwen2.5-VL
(G 4, 4 new tokens, a fixed reward) with a CSVLogger and ``log_every_n_steps 1`` (every step writes all
~30 metrics, the real-size configs' setting). It times, per step, the wall and CPU seconds spent logging:
the module's ``self.log_dict`` calls, the queued merge of the diagnostics
(:func:`mmpo.training.step_logging.log_with_step_metrics`) and Lightning's write to the logger
(``LoggerConnector.update_train_step_metrics``). The two sides:

- ``mmpo``: the current code (shared and monitored keys through ``self.log``, the rest merged into
  Lightning's logger call);
- ``self_log``: the same run with the diagnostics sent through ``self.log_dict`` too (the path before).

Rounds are interleaved A B B A so that drifting machine load falls on both sides. Prints the median per-step
milliseconds (wall and CPU) of each side and their ratio; ``--out`` also writes the raw rounds as JSON.

    python bench/bench_logging_cost.py                        # 4 rounds of A B B A, 20 steps each
    python bench/bench_logging_cost.py --rounds 2 --steps 6   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("mmpo", "self_log")


def worker(side: str, model_dir: str, steps: int, log_dir: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    import mmpo.algos.grpo as grpo
    from mmpo.data.synthetic import make_items
    from mmpo.training.config import OptimConfig, SamplingConfig

    class FixedReward(grpo.GRPOModule):
        def compute_rewards(self, rollout):  # no reward worker: the step is the module's own work
            return torch.linspace(0, 1, len(rollout)), {"rewards/fixed/mean": 0.5}

    clock = {"wall": 0.0, "cpu": 0.0}

    def timed(function):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                clock["wall"] += time.perf_counter() - wall
                clock["cpu"] += time.process_time() - cpu
        return run

    if side == "self_log":
        def through_self_log(module, metrics, order):
            if metrics:
                module.log_dict(dict(metrics), on_step=True, on_epoch=False)
        grpo.log_with_step_metrics = through_self_log
    grpo.log_with_step_metrics = timed(grpo.log_with_step_metrics)

    module = FixedReward(model_dir, sampling=SamplingConfig(num_generations=4, max_new_tokens=4),
                         optim=OptimConfig(lr=1e-4, micro_batch_size=2))
    module.log_dict = timed(module.log_dict)
    per_step: list[dict] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):  # the step's clock starts (recorded after Lightning's write)
            clock.update(wall=0.0, cpu=0.0)

    rows = make_items("count_shapes", 2 * steps, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(log_dir),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock()])
    connector = trainer._logger_connector
    write = timed(connector.update_train_step_metrics)

    def update_and_record() -> None:
        write()
        per_step.append(dict(clock))

    connector.update_train_step_metrics = update_and_record
    trainer.fit(module, DataLoader([rows[i:i + 2] for i in range(0, len(rows), 2)], batch_size=None,
                                   collate_fn=lambda x: x))
    timed_steps = per_step[2:]  # the first two warm up (result collection built, CSV header written)
    return {"side": side, "steps": len(timed_steps),
            "wall_ms": 1e3 * statistics.median(s["wall"] for s in timed_steps),
            "cpu_ms": 1e3 * statistics.median(s["cpu"] for s in timed_steps),
            "keys": len(module.last_metrics)}


def _spawn(side: str, model_dir: str, steps: int, root: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, __file__, "--worker", side, "--model", model_dir, "--steps", str(steps),
                             "--log-dir", str(root / f"logs_{side}")], env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _build_model(root: Path) -> str:
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_vlm

    texts = [SYSTEM_PROMPT, *corpus(["count_shapes"], n=20)]
    return str(build_tiny_vlm(root / "tiny", corpus=texts, vocab_size=400, hidden_size=64, intermediate_size=128))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds: each runs both sides twice")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run (the first 2 are not timed)")
    parser.add_argument("--out", default=None, help="also write the raw rounds as JSON here")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.steps, args.log_dir)))
        return 0
    if args.steps < 3:
        parser.error("--steps must be at least 3 (2 warm-up steps are not timed)")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = _build_model(root)
        for _ in range(args.rounds):
            for side in ("mmpo", "self_log", "self_log", "mmpo"):  # A B B A
                runs.append(_spawn(side, model_dir, args.steps, root))
                print(f"  {side:9s} wall {runs[-1]['wall_ms']:.3f} ms/step  cpu {runs[-1]['cpu_ms']:.3f} ms/step",
                      flush=True)
    median = {side: {k: statistics.median(r[k] for r in runs if r["side"] == side) for k in ("wall_ms", "cpu_ms")}
              for side in SIDES}
    print(f"\nlogging cost per step ({args.rounds} ABBA rounds x {args.steps} steps, "
          f"{runs[0]['keys']} metrics, log_every_n_steps 1):")
    print("| side | wall ms / step | CPU ms / step |\n|---|---|---|")
    for side in SIDES:
        print(f"| {side} | {median[side]['wall_ms']:.3f} | {median[side]['cpu_ms']:.3f} |")
    ratio = median["mmpo"]["wall_ms"] / median["self_log"]["wall_ms"]
    print(f"mmpo / self_log (wall): {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": runs, "median": median}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
