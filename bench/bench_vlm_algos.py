"""Benchmark: GRPO vs PAPO-G vs MAPO (issue 4) and GRPO vs StepGRPO vs GCPO vs AHPO (issue 5)
on a tiny Qwen2.5-VL, CPU.

One tiny model is built, SFT-warmed once per solution style (think-answer; "steps" for
StepGRPO; a short "weak" SFT for the AHPO weak-start comparison), then every algorithm runs
the same RL budget from the same checkpoint with the same seeds and data, and is scored by
greedy held-out accuracy per task (the tasks' test split). PAPO's extra cost is reported as the
ratio of its mean step time to GRPO's within the same seed.

    python bench/bench_vlm_algos.py --seeds 3 --rl-steps 6 --eval-size 12

Results go to ``--out`` (``results.json``, updated after every run so a crash loses nothing and a
rerun skips finished runs; ``summary.md``). Budget and seeds are options so a bigger machine can
rerun it larger.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import mmpo.data.geometry_aux  # noqa: E402,F401  (registers geometry_aux)
from mmpo.data import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT  # noqa: E402
from mmpo.data.datamodule import PromptDataModule  # noqa: E402
from mmpo.data.synthetic import make_items  # noqa: E402
from mmpo.eval.heldout import heldout_accuracy  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402
from mmpo.training.config import OptimConfig, merged_settings  # noqa: E402

TASKS = ["count_shapes", "geometry_aux"]

# name -> (module class path, SFT checkpoint kind, extra init args); every run shares the common args
ALGORITHMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "grpo": ("mmpo.algos.grpo.GRPOModule", "sft", {}),
    "papo_g": ("mmpo.algos.papo.PAPOModule", "sft", {"gamma": 0.02}),
    "mapo": ("mmpo.algos.mapo.MAPOModule", "sft", {"advantage": {"name": "mapo"}}),
    "stepgrpo": ("mmpo.algos.stepgrpo.StepGRPOModule", "sft_steps",
                 {"sampling": {"temperature": 1.0}, "advantage": {"eps": 1e-4}}),
    "gcpo": ("mmpo.algos.gcpo.GCPOModule", "sft", {"length_cap": 900}),
    "ahpo": ("mmpo.algos.ahpo.AHPOModule", "sft", {}),
    "grpo_weak": ("mmpo.algos.grpo.GRPOModule", "sft_weak", {}),
    "ahpo_weak": ("mmpo.algos.ahpo.AHPOModule", "sft_weak", {}),
    # PPO with a learned critic (mmpo.algos.ppo): the critic at the RL learning rate (set in run_one)
    "ppo": ("mmpo.algos.ppo.PPOModule", "sft", {}),
    # DVPO (mmpo.algos.dvpo): PPO against the frozen global value model pretrained on the SFT start
    # (build_value, --value-steps); its KL is in the token reward (kl_coef 0.2, official), no KL loss term
    "dvpo": ("mmpo.algos.dvpo.DVPOModule", "sft", {}),
}
#: paired contrasts over seeds in the summary, when both sides ran (issue 41: DVPO vs PPO + critic vs GRPO)
PAIRED = [("ppo", "grpo"), ("dvpo", "ppo"), ("dvpo", "grpo")]
ISSUES = {"4": ["grpo", "papo_g", "mapo"], "5": ["grpo", "stepgrpo", "gcpo", "ahpo", "grpo_weak", "ahpo_weak"]}


class StepTimer(L.Callback):
    """Wall time of every training step (rollout + rewards + update)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def _import(path: str):
    module_name, class_name = path.rsplit(".", 1)
    return getattr(__import__(module_name, fromlist=[class_name]), class_name)


def _trainer(root: Path, max_steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1, logger=L.pytorch.loggers.CSVLogger(root),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, log_every_n_steps=1, callbacks=callbacks,
    )


def build_sft(kind: str, init: Path, out: Path, args: argparse.Namespace) -> Path:
    """SFT warm-up (think-answer, "steps" style, or a short weak one); cached in ``out``."""
    from mmpo.algos.sft import SFTModule

    target = out / kind / "hf"
    if (target / "config.json").exists():
        return target
    steps = {"sft": args.sft_steps, "sft_steps": args.sft_steps, "sft_weak": args.weak_sft_steps}[kind]
    style = "steps" if kind == "sft_steps" else "think-answer"
    L.seed_everything(0, verbose=False)
    data = PromptDataModule(tasks=TASKS, train_size=args.sft_train_size, val_size=0, seed=0, batch_size=8)
    module = SFTModule(model_path=str(init), optim=OptimConfig(lr=args.sft_lr), style=style,
                       output_dir=str(target), save_hf_on_checkpoint=False)
    t0 = time.perf_counter()
    _trainer(out / kind, steps, []).fit(module, datamodule=data)
    print(f"[bench] {kind}: {steps} SFT steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def build_value(sft: Path, out: Path, args: argparse.Namespace) -> Path:
    """DVPO stage 1 (mmpo.algos.dvpo.GlobalValueModule) on the SFT start: preference pairs of the bench's tasks
    (the reference solution +1, the same reasoning with a wrong answer -1), ``--value-steps`` optimizer steps
    (value_epochs 2 per batch of 8 pairs), lr ``--value-lr``, linear decay; cached in ``out/dvpo_value``."""
    from mmpo.algos.dvpo import GlobalValueModule
    from mmpo.data.datamodule import PreferenceDataModule

    target = out / "dvpo_value" / "hf"
    if (target / "config.json").exists():
        return target
    L.seed_everything(0, verbose=False)
    data = PreferenceDataModule(tasks=TASKS, train_size=args.value_train_size, val_size=0, seed=0, batch_size=8)
    module = GlobalValueModule(model_path=str(sft), optim=OptimConfig(lr=args.value_lr, lr_schedule="linear",
                                                                       max_grad_norm=1.0),
                               output_dir=str(target))
    t0 = time.perf_counter()
    _trainer(out / "dvpo_value", args.value_steps, []).fit(module, datamodule=data)
    final = {k: round(module.last_metrics[k], 3) for k in ("value/final_chosen_mean", "value/final_rejected_mean")}
    print(f"[bench] dvpo value model: {args.value_steps} steps in {time.perf_counter() - t0:.0f} s, {final}", flush=True)
    return target


def make_module(name: str, seed: int, sft_paths: dict[str, Path], args) -> L.LightningModule:
    """The RL module of ``name`` with the bench's shared settings (seeded)."""
    class_path, sft_kind, extra = ALGORITHMS[name]
    L.seed_everything(seed, verbose=False)
    beta = 0.04 if name == "stepgrpo" else 0.0 if name.startswith("ahpo") or name == "gcpo" else 0.01
    common = dict(sampling={"num_generations": args.group_size, "max_new_tokens": args.max_new_tokens},
                  optim={"lr": args.rl_lr}, loss={"beta": beta, "clip_low": 0.2, "clip_high": 0.3},
                  seed=seed, rewards={"timeout_s": None})
    if name == "ppo":
        extra = {**extra, "critic": {"lr": args.rl_lr}}
    if name == "dvpo":  # the KL is in the token reward (kl_coef), not a loss term
        extra = {**extra, "critic": {"path": str(sft_paths["dvpo_value"])}}
        common = {**common, "loss": {**common["loss"], "beta": 0.0}}
    return _import(class_path)(str(sft_paths[sft_kind]), **merged_settings(common, extra))


def run_one(name: str, seed: int, sft_paths: dict[str, Path], eval_rows, out: Path, args) -> dict[str, Any]:
    module = make_module(name, seed, sft_paths, args)
    data = PromptDataModule(tasks=TASKS, train_size=args.rl_train_size, val_size=0, seed=seed,
                            batch_size=args.prompts_per_step)
    timer = StepTimer()
    t0 = time.perf_counter()
    _trainer(out / "runs" / f"{name}_s{seed}", args.rl_steps, [timer]).fit(module, datamodule=data)
    train_s = time.perf_counter() - t0
    system_prompt = STEPS_SYSTEM_PROMPT if name == "stepgrpo" else SYSTEM_PROMPT
    accuracy = heldout_accuracy(module.model, module.processor, eval_rows, system_prompt=system_prompt,
                                max_new_tokens=args.max_new_tokens)
    metrics = {k: float(v) for k, v in getattr(module, "last_metrics", {}).items()}
    return {"algo": name, "seed": seed, "accuracy": accuracy, "train_s": train_s,
            "step_s": timer.seconds, "last_metrics": metrics}


def summarize(results: list[dict[str, Any]], baseline_acc: dict[str, dict[str, float]]) -> str:
    lines = ["| algo | " + " | ".join(TASKS) + " | all | mean step s | n seeds |", "|---" * (len(TASKS) + 4) + "|"]
    starts = {kind for _, kind, _ in ALGORITHMS.values()}
    for kind, acc in baseline_acc.items():
        if kind not in starts:  # an earlier version also scored DVPO's value model as if it were a policy
            continue
        lines.append(f"| {kind} (start, no RL) | " + " | ".join(f"{acc[t]:.3f}" for t in TASKS)
                     + f" | {acc['all']:.3f} | - | - |")
    by_algo: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_algo.setdefault(r["algo"], []).append(r)
    for name in ALGORITHMS:
        runs = by_algo.get(name)
        if not runs:
            continue
        cells = []
        for key in [*TASKS, "all"]:
            values = [r["accuracy"][key] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
        step = statistics.mean(s for r in runs for s in r["step_s"][1:] or r["step_s"])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {step:.2f} | {len(runs)} |")
    # paired over seeds (same seed: same data order and first rollout): a - b, mean and Student-t 95% interval
    from mmpo.eval.stats import format_interval, seed_t_interval

    for a, b in PAIRED:
        seeds = sorted({r["seed"] for r in by_algo.get(a, [])} & {r["seed"] for r in by_algo.get(b, [])})
        if not seeds:
            continue
        cells = []
        for key in [*TASKS, "all"]:
            diffs = [next(r for r in by_algo[a] if r["seed"] == s)["accuracy"][key]
                     - next(r for r in by_algo[b] if r["seed"] == s)["accuracy"][key] for s in seeds]
            cells.append(f"{statistics.mean(diffs):+.3f} {format_interval(seed_t_interval(diffs))}")
        lines.append(f"| {a} - {b}, paired | " + " | ".join(cells) + f" | - | {len(seeds)} |")
    # PAPO's cost: per seed, mean PAPO step time / mean GRPO step time (first step excluded: warm-up)
    ratios = []
    for r in by_algo.get("papo_g", []):
        base = [g for g in by_algo.get("grpo", []) if g["seed"] == r["seed"]]
        if base:
            papo = statistics.mean(r["step_s"][1:] or r["step_s"])
            grpo = statistics.mean(base[0]["step_s"][1:] or base[0]["step_s"])
            ratios.append(papo / grpo)
    if ratios:
        lines.append("")
        lines.append(f"PAPO-G step time / GRPO step time per seed: {', '.join(f'{x:.2f}' for x in ratios)} "
                     f"(mean {statistics.mean(ratios):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_vlm_algos"))
    parser.add_argument("--issues", default="4,5", help="comma-separated: 4 (GRPO/PAPO-G/MAPO), 5 (GRPO/StepGRPO/GCPO/AHPO)")
    parser.add_argument("--algos", default=None, help="comma-separated subset of " + ",".join(ALGORITHMS))
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds per algorithm (>= 3 for a spread)")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--weak-sft-steps", type=int, default=30, help="SFT steps of the weak start (AHPO weak)")
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--sft-train-size", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=6)
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--rl-train-size", type=int, default=64)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--eval-size", type=int, default=12, help="held-out items per task")
    parser.add_argument("--value-steps", type=int, default=120, help="DVPO value-model pretraining optimizer steps")
    parser.add_argument("--value-lr", type=float, default=1e-4)
    parser.add_argument("--value-train-size", type=int, default=480, help="DVPO value-model preference pairs")
    args = parser.parse_args(argv)

    from mmpo.vlm.factory import build_tiny_vlm, load_vlm

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    state = json.loads(results_path.read_text()) if results_path.exists() else {"runs": [], "baseline": {}}
    state["args"] = {k: str(v) for k, v in vars(args).items()}
    init = out / "init"
    if not (init / "config.json").exists():
        build_tiny_vlm(init, seed=0)
    names = [n for issue in args.issues.split(",") for n in ISSUES[issue.strip()]]
    names = list(dict.fromkeys(args.algos.split(",") if args.algos else names))
    kinds = sorted({ALGORITHMS[n][1] for n in names})
    sft_paths = {kind: build_sft(kind, init, out, args) for kind in kinds}
    if "dvpo" in names:
        sft_paths["dvpo_value"] = build_value(sft_paths["sft"], out, args)
    eval_rows = [row for task in TASKS for row in make_items(task, args.eval_size, seed=1234, split="test")]
    for kind in kinds:  # the policies' starts (not DVPO's value model)
        path = sft_paths[kind]
        if kind not in state["baseline"]:
            model, processor = load_vlm(path)
            prompt = STEPS_SYSTEM_PROMPT if kind == "sft_steps" else SYSTEM_PROMPT
            state["baseline"][kind] = heldout_accuracy(model, processor, eval_rows, system_prompt=prompt,
                                                       max_new_tokens=args.max_new_tokens)
            atomic_write_json(results_path, state)
    done = {(r["algo"], r["seed"]) for r in state["runs"]}
    for seed in range(args.seeds):
        for name in names:
            if (name, seed) in done:
                continue
            result = run_one(name, seed, sft_paths, eval_rows, out, args)
            print(f"[bench] {name} seed {seed}: {result['accuracy']} ({result['train_s']:.0f} s)", flush=True)
            state["runs"].append(result)
            atomic_write_json(results_path, state)
    summary = summarize(state["runs"], state["baseline"])
    (out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
