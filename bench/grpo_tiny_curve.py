"""Learning check on CPU: tiny Qwen2.5-VL -> SFT warm-up -> GRPO, held-out accuracy before/after.

Usage (2 shared cores; a few minutes):
    python bench/grpo_tiny_curve.py --out runs/grpo_curve --sft-steps 300 --grpo-steps 60

Prints greedy held-out accuracy (synthetic "test" split) after SFT and after GRPO,
per task and overall, with wall-clock times; writes ``summary.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from mmpo.algos.grpo import GRPOModule  # noqa: E402
from mmpo.algos.sft import SFTModule  # noqa: E402
from mmpo.data.datamodule import PromptDataModule  # noqa: E402
from mmpo.data.synthetic import make_items  # noqa: E402
from mmpo.vlm.factory import build_tiny_vlm  # noqa: E402
from mmpo.eval.heldout import checkpoint_heldout_accuracy  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig  # noqa: E402


def held_out_accuracy(model_dir: Path, tasks: list[str], n: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy accuracy per task on the synthetic test split (n items per task)."""
    rows = [row for task in tasks for row in make_items(task, n, seed=1234, split="test")]
    return checkpoint_heldout_accuracy(model_dir, rows, max_new_tokens=max_new_tokens, batch_size=32)


def trainer(max_steps: int, root: Path, name: str) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=L.pytorch.loggers.CSVLogger(root, name=name),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/grpo_tiny_curve"))
    parser.add_argument("--tasks", nargs="+", default=["count_shapes", "relative_position", "compare_size",
                                                       "bar_chart", "arithmetic"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--grpo-steps", type=int, default=60, help="GRPO training steps (batches)")
    parser.add_argument("--grpo-batch", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--eval-n", type=int, default=64, help="held-out items per task")
    parser.add_argument("--sft-dir", type=Path, default=None, help="reuse this SFT output (skips build and SFT)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(args.seed, verbose=False)
    timings = {}

    sft_dir = args.sft_dir or args.out / "sft"
    if args.sft_dir is None:
        t = time.perf_counter()
        base = build_tiny_vlm(args.out / "base", seed=args.seed, hidden_size=args.hidden_size,
                              num_layers=args.num_layers)
        timings["build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sft = SFTModule(str(base), optim=OptimConfig(lr=args.sft_lr, warmup_steps=20, lr_schedule="cosine"),
                        output_dir=str(sft_dir), save_hf_on_checkpoint=False)
        data = PromptDataModule(tasks=args.tasks, train_size=args.train_size, val_size=8, seed=args.seed,
                                batch_size=args.sft_batch)
        trainer(args.sft_steps, args.out, "sft").fit(sft, datamodule=data)
        timings["sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    before = held_out_accuracy(sft_dir, args.tasks, args.eval_n, args.max_new_tokens)
    timings["eval_s"] = time.perf_counter() - t
    print("after SFT  :", json.dumps(before), flush=True)

    t = time.perf_counter()
    grpo = GRPOModule(str(sft_dir),
                      sampling=SamplingConfig(num_generations=args.num_generations, max_new_tokens=args.max_new_tokens, temperature=args.temperature),
                      optim=OptimConfig(lr=args.grpo_lr),
                      loss=LossConfig(beta=args.beta, clip_high=0.28),
                      output_dir=str(args.out / "grpo"), seed=args.seed,
                      rewards=RewardConfig(timeout_s=None))
    data = PromptDataModule(tasks=args.tasks, train_size=args.train_size, val_size=8, seed=args.seed,
                            batch_size=args.grpo_batch)
    trainer(args.grpo_steps, args.out, "grpo").fit(grpo, datamodule=data)
    timings["grpo_s"] = time.perf_counter() - t
    after = held_out_accuracy(args.out / "grpo", args.tasks, args.eval_n, args.max_new_tokens)
    print("after GRPO :", json.dumps(after), flush=True)
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "after_sft": before, "after_grpo": after,
               "timings_s": timings}
    atomic_write_json(args.out / "summary.json", summary, indent=2)
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
