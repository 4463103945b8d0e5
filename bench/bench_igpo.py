"""IGPO vs diffu-GRPO from the same SFT checkpoint, same seeds and budget (CPU, tiny model).

For each method and seed: train ``DiffuGRPO`` (configs/dllm/{igpo,grpo}_tiny.yaml settings,
``igpo.enabled`` on/off) for ``--batches`` batches of rollouts, and record

- the fraction of all-wrong groups per batch: as sampled (before hints) and after IGPO's
  replacement (for GRPO the two are equal); the latter is the count of groups that carry
  no learning signal, the quantity IGPO reduces (paper: about 60% fewer);
- held-out greedy accuracy on ``--eval-size`` test problems before and after training.

Results (means and per-seed values) go to ``--out`` as JSON and a markdown table.

    python bench/bench_igpo.py --seeds 0 1 2 --jobs 2   # the tiny configs' settings: 150 x 16 prompts, lr 1e-4
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

from mmpo.files import atomic_write_json  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def run_one(method: str, seed: int, args: argparse.Namespace, test_rows: list[dict]) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from mmpo.dllm.data import ArithmeticDataModule
    from mmpo.dllm.hints import HintConfig
    from mmpo.dllm.igpo import CORE_LOSS
    from mmpo.dllm.rl import DiffuGRPO
    from mmpo.dllm.rollout import greedy_accuracy
    from mmpo.dllm.sampler import SamplerConfig
    from mmpo.dllm.task import ArithmeticTaskConfig

    pl.seed_everything(seed, verbose=False)
    from mmpo.dllm.modeling import read_generation_defaults

    # The SFT checkpoint's canvas (configs/dllm/sft_tiny.yaml: L 24, block 8, steps 12), rollouts at --temperature (1.2).
    saved = read_generation_defaults(args.sft_model).get("sampler", {})
    sampler = SamplerConfig(**{**saved, "temperature": args.temperature})
    weights = {"correct": 1.0, **({args.format_reward: 1.0} if args.format_reward else {})}
    module = DiffuGRPO(
        model_path=args.sft_model, warmup_config=None, save_dir=str(Path(args.workdir) / f"{method}_{seed}" / "model"),
        sampler=sampler, group_size=args.group_size,
        optim={"mu": args.inner_updates, "lr": args.lr, "warmup_steps": 5},
        # --ratio-level names the loss as the flat setting did (token -> ppo, sequence -> igpo_sequence, ...)
        loss={"name": CORE_LOSS[args.ratio_level], "beta": args.beta, "agg": args.loss_agg},
        logprob={"masking": args.masking}, rewards={"weights": weights},
        igpo={"enabled": method == "igpo", "max_replacements": args.group_size // 2},
        hints=HintConfig(min_chunk=3, max_chunk=6, free_tail=round(30 / 256 * sampler.gen_length),
                         max_stretch=args.max_stretch, trace_free_tail=args.trace_free_tail),
        seed=seed,
    )
    # Data seed 0 for every run (same held-out rows, same prompt order); the run seed drives the rollouts.
    data = ArithmeticDataModule(task=ArithmeticTaskConfig(), train_size=2500, test_size=256, val_size=8,
                                batch_size=args.prompts_per_batch, seed=0)
    root = Path(args.workdir) / f"{method}_{seed}"
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.batches * args.inner_updates, logger=CSVLogger(str(root)),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    started = time.time()
    trainer.fit(module, datamodule=data)
    seconds = time.time() - started
    accuracy = greedy_accuracy(module.model, module.tokenizer, test_rows, sampler, batch_size=64)
    sampled = sampled_accuracy(module.model, module.tokenizer, test_rows, sampler, args.eval_samples, seed)
    with open(next(root.rglob("metrics.csv"))) as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("igpo/frac_all_wrong_sampled")]
    series = lambda key: [float(r[key]) for r in rows]  # noqa: E731
    return {
        "method": method, "seed": seed, "seconds": round(seconds, 1), "heldout_accuracy": accuracy,
        "heldout_sampled_accuracy": sampled,
        "frac_all_wrong_sampled": series("igpo/frac_all_wrong_sampled"),
        "frac_all_wrong": series("igpo/frac_all_wrong"),
        "train_correct": series("rewards/correct/mean"),
        "num_replaced": series("igpo/num_replaced"),
    }


def sampled_accuracy(model, tokenizer, rows: list[dict], sampler, samples: int, seed: int) -> float:
    """Held-out accuracy of rollouts at the training temperature (mean over ``samples`` per problem)."""
    from mmpo.dllm.rollout import sampled_accuracy as dllm_sampled_accuracy

    return dllm_sampled_accuracy(model, tokenizer, rows, sampler, samples,
                                 generator=torch.Generator().manual_seed(10_000 + seed))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(results: list[dict], base_accuracy: float) -> dict:
    out = {"base_heldout_accuracy": base_accuracy[0], "base_heldout_sampled_accuracy": base_accuracy[1], "methods": {}}
    for method in ("grpo", "igpo"):
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        per_seed = lambda key: [mean(r[key]) for r in runs]  # noqa: E731
        halves = lambda key, h: [mean(r[key][: len(r[key]) // 2] if h == 0 else r[key][len(r[key]) // 2 :]) for r in runs]  # noqa: E731
        acc = [r["heldout_accuracy"] for r in runs]
        sampled = [r["heldout_sampled_accuracy"] for r in runs]
        out["methods"][method] = {
            "frac_all_wrong": mean(per_seed("frac_all_wrong")),
            "frac_all_wrong_first_half": mean(halves("frac_all_wrong", 0)),
            "frac_all_wrong_second_half": mean(halves("frac_all_wrong", 1)),
            "frac_all_wrong_sampled": mean(per_seed("frac_all_wrong_sampled")),
            "train_correct": mean(per_seed("train_correct")),
            "train_correct_first_quarter": mean([mean(r["train_correct"][: len(r["train_correct"]) // 4]) for r in runs]),
            "train_correct_last_quarter": mean([mean(r["train_correct"][-(len(r["train_correct"]) // 4) :]) for r in runs]),
            "heldout_accuracy": mean(acc),
            "heldout_accuracy_std": statistics.pstdev(acc) if len(acc) > 1 else 0.0,
            "heldout_accuracy_per_seed": acc,
            "heldout_sampled_accuracy": mean(sampled),
            "heldout_sampled_accuracy_std": statistics.pstdev(sampled) if len(sampled) > 1 else 0.0,
            "heldout_sampled_accuracy_per_seed": sampled,
            "replaced_per_batch": mean(per_seed("num_replaced")),
            "seconds_per_run": mean([r["seconds"] for r in runs]),
        }
    methods = out["methods"]
    if "grpo" in methods and "igpo" in methods and methods["grpo"]["frac_all_wrong"] > 0:
        out["all_wrong_reduction"] = 1.0 - methods["igpo"]["frac_all_wrong"] / methods["grpo"]["frac_all_wrong"]
    return out


def markdown(summary: dict, args: argparse.Namespace) -> str:
    lines = [
        "| method | all-wrong groups (after replacement) | first half | second half | all-wrong as sampled | "
        "train accuracy (sampled): first -> last quarter | held-out greedy accuracy | per seed | held-out sampled accuracy (rollout tau) | per seed | "
        "replaced / batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in summary["methods"].items():
        lines.append(
            f"| {method} | {m['frac_all_wrong']:.3f} | {m['frac_all_wrong_first_half']:.3f} | "
            f"{m['frac_all_wrong_second_half']:.3f} | {m['frac_all_wrong_sampled']:.3f} | "
            f"{m['train_correct_first_quarter']:.3f} -> {m['train_correct_last_quarter']:.3f} | "
            f"{m['heldout_accuracy']:.3f} ± {m['heldout_accuracy_std']:.3f} | "
            f"{', '.join(f'{a:.3f}' for a in m['heldout_accuracy_per_seed'])} | "
            f"{m['heldout_sampled_accuracy']:.3f} ± {m['heldout_sampled_accuracy_std']:.3f} | "
            f"{', '.join(f'{a:.3f}' for a in m['heldout_sampled_accuracy_per_seed'])} | {m['replaced_per_batch']:.2f} |"
        )
    lines.append("")
    lines.append(f"SFT checkpoint (start of both): held-out greedy accuracy {summary['base_heldout_accuracy']:.3f}, "
                 f"sampled (rollout tau) {summary['base_heldout_sampled_accuracy']:.3f}")
    if "all_wrong_reduction" in summary:
        lines.append(f"All-wrong groups, IGPO vs GRPO: {100 * summary['all_wrong_reduction']:.0f}% fewer")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", default="runs/dllm/sft_tiny/model")
    parser.add_argument("--sft-config", default=str(REPO / "configs/dllm/sft_tiny.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["grpo", "igpo"], choices=["grpo", "igpo"])
    parser.add_argument("--batches", type=int, default=150, help="batches of rollouts per run")
    parser.add_argument("--prompts-per-batch", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--inner-updates", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--format-reward", default=None, choices=["derivation"], help="add the task's format reward")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (one core each)")
    parser.add_argument("--beta", type=float, default=0.01, help="k3 KL coefficient")
    parser.add_argument("--temperature", type=float, default=1.2, help="rollout temperature")
    parser.add_argument("--ratio-level", default="sequence", choices=["sequence", "sequence_masked", "token"],
                        help="sequence: IGPO's official ratio over all L; sequence_masked: GSPO-token over the loss mask")
    parser.add_argument("--max-stretch", type=float, default=1.0,
                        help="hint position stretch cap (official 1.5; tiny configs 1.0: traces are EOS-padded, not stretched)")
    parser.add_argument("--trace-free-tail", type=int, default=5,
                        help="last trace tokens never hinted (official 0; tiny configs 5 = the answer line)")
    parser.add_argument("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean-token-mean"])
    parser.add_argument("--masking", default="full", choices=["full", "structured"],
                        help="log-prob estimator: one-pass (full) or IGPO's structured timesteps")
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled answers per held-out problem")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default="runs/bench/dllm_igpo.json", help="JSON with every run (the summary table is printed)")
    args = parser.parse_args(argv)
    from mmpo.dllm.rollout import greedy_accuracy
    from mmpo.dllm.modeling import load_mask_predictor, read_generation_defaults
    from mmpo.dllm.sampler import SamplerConfig
    from mmpo.dllm.task import ArithmeticTaskConfig, make_train_and_test
    from mmpo.dllm.warmup import ensure_warm_model

    ensure_warm_model(args.sft_model, args.sft_config)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_igpo_")
    _, test_rows = make_train_and_test(ArithmeticTaskConfig(), 0, 256, seed=0)
    test_rows = test_rows[: args.eval_size]
    model, tokenizer = load_mask_predictor(args.sft_model)
    sampler = SamplerConfig(**read_generation_defaults(args.sft_model).get("sampler", {}))
    rollout_sampler = SamplerConfig(**{**vars(sampler), "temperature": args.temperature})
    base_accuracy = (greedy_accuracy(model, tokenizer, test_rows, sampler),
                     sampled_accuracy(model, tokenizer, test_rows, rollout_sampler, args.eval_samples, 0))
    print(f"SFT held-out accuracy: greedy {base_accuracy[0]:.3f}, sampled {base_accuracy[1]:.3f}", flush=True)
    results = []
    runs = [(method, seed) for seed in args.seeds for method in args.methods]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_one, method, seed, args, test_rows) for method, seed in runs]
        for future in as_completed(futures):
            result = future.result()
            results.append(result)
            method, seed = result["method"], result["seed"]
            print(f"{method} seed {seed}: held-out greedy {result['heldout_accuracy']:.3f} sampled "
                  f"{result['heldout_sampled_accuracy']:.3f}, all-wrong "
                  f"{mean(result['frac_all_wrong']):.3f} (sampled {mean(result['frac_all_wrong_sampled']):.3f}), "
                  f"{result['seconds']}s", flush=True)
            atomic_write_json(args.out, {"args": vars(args), "runs": results})
    results.sort(key=lambda r: (r["method"], r["seed"]))
    summary = summarize(results, base_accuracy)
    atomic_write_json(args.out, {"args": vars(args), "summary": summary, "runs": results})
    print(markdown(summary, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
