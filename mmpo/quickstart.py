"""``mmpo quickstart``: the whole VLM pipeline on a laptop CPU.

1. build a tiny Qwen2.5-VL (``build_tiny_vlm``: config + tokenizer trained on the synthetic corpus);
2. evaluate it on held-out synthetic items (before SFT);
3. SFT warm-up (Lightning ``Trainer`` + ``SFTModule``) on rendered think/answer solutions from an
   imperfect teacher that abstains ("unsure") on 80% of the questions about red, blue or green
   shapes (``mmpo.data.demonstrations``); evaluate;
4. GRPO (Lightning ``Trainer`` + ``GRPOModule``, arXiv 2402.03300) with the accuracy + format
   reward; evaluate on the same held-out items;
5. print the table (before SFT / after SFT / after GRPO per task), save the eval bars and the
   RL learning curve (reward and val accuracy per step, from Lightning's CSV logger).

Everything goes under ``--out``: ``model_init/``, ``sft/`` and ``grpo/`` (Lightning logs,
checkpoints, ``hf/`` exports loadable by ``mmpo eval``), ``eval/<stage>/`` (results.json, ...),
``quickstart.json``, ``results.md``, ``eval.png``, ``learning_curve.png``.
A finished stage is not rerun when the command is repeated with the same ``--out``, and an
interrupted training stage resumes from its last Lightning checkpoint (``last.ckpt``, or
``last.prev.ckpt`` when ``last.ckpt`` is damaged; the metrics logged before the interruption are
kept: each resume logs to a new ``logs/version_N`` and the curve joins them). ``--fresh`` moves
an existing ``--out`` aside to ``OUT.old-<time>`` and starts over. ``--out`` is locked while a
run writes it.

Why the abstaining teacher: at this scale (a 0.8M-parameter model seeing a 56 px image as 4 tokens)
the tiny VLM barely perceives the images, and GRPO from a plain SFT start does not show a gain over
5 seeds (bench/RESULTS.md "quickstart-verdict"). What RL adds to imitation is shown instead where it
is unambiguous: the SFT model copies the teacher's abstentions, GRPO is rewarded only for correct
answers and learns to attempt those questions. ``--abstain-share 0`` runs the plain teacher. ``--kind text`` runs
the same stages and teacher on a tiny Qwen3 text LM and the text task ``inventory`` (bench/RESULTS.md
"text-quickstart-teacher"; docs/llm.md).

The default budget takes about 3 minutes on 2 idle CPU cores (bench/RESULTS.md "Quickstart"; up to
~10 minutes when the cores are busy); ``--tiny`` is a seconds-long smoke run (it checks the plumbing,
not learning).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

STAGES = ("before SFT", "after SFT", "after GRPO")
TEXT_QUICKSTART_TASKS = ("inventory",)
"""The task of ``mmpo quickstart --kind text`` (``mmpo.data.synthetic.TEXT_TEACHER_TASKS``): a text lookup the tiny
text LM learns, whose questions name a colour, so the abstaining teacher applies as in the VLM quickstart. On the
harder ``TEXT_TASKS`` (``--tasks long_arithmetic,word_problem,countdown --abstain-share 0``) the tiny model answers
1-3% after SFT and the GRPO gain is not shown (bench/RESULTS.md "text-quickstart")."""
TEXT_QUICKSTART_GRPO_STEPS = 100
"""GRPO steps of ``--kind text`` (the training reward and the validation accuracy level off by about step 25;
bench/RESULTS.md "text-quickstart-teacher")."""


class StaleOutputError(ValueError):
    """``--out`` holds a finished stage made with different settings (reusing it would mix runs)."""


@dataclass(frozen=True)
class QuickstartConfig:
    """Budget of one quickstart run (defaults: the ~3 minute CPU run)."""

    tasks: tuple[str, ...] = ("count_shapes", "compare_size", "bar_chart")
    """synthetic tasks to train and evaluate on (``mmpo.data.synthetic.TASKS``)."""
    kind: str = "vlm"
    """the model: ``vlm`` (a tiny Qwen2.5-VL) or ``text`` (a tiny Qwen3 text LM, docs/llm.md)."""
    model_size: dict[str, int] = field(default_factory=lambda: dict(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384))
    """``build_tiny_vlm`` sizes."""
    corpus_items: int = 200
    """items per task and split used to train the tokenizer."""
    sft_train_size: int = 4800
    """SFT training items (all tasks together): one pass of 300 x 16, so SFT does not memorise its items."""
    sft_batch_size: int = 16
    """SFT prompts per step."""
    sft_steps: int = 300
    """SFT optimizer steps."""
    sft_lr: float = 1e-3
    """SFT learning rate."""
    sft_abstain_colours: tuple[str, ...] = ("red", "blue", "green")
    """colours whose questions the SFT teacher may abstain on (``mmpo.data.demonstrations``)."""
    sft_abstain_share: float = 0.8
    """share of those questions the teacher abstains on (0: the plain teacher). Greedy decoding after SFT
    then abstains on every such question (3 of 5 colours: about 58% of the held-out items)."""
    grpo_train_size: int = 4000
    """GRPO training prompts (all tasks together): fresh prompts every step (600 prompts seen ~3 times each
    raised the training reward without any held-out gain: memorised items)."""
    grpo_prompts_per_step: int = 8
    """GRPO prompts per step."""
    grpo_group_size: int = 8
    """G: rollouts per prompt."""
    grpo_steps: int = 200
    """GRPO steps (one rollout batch and one optimizer step each)."""
    grpo_lr: float = 1e-4
    """GRPO learning rate."""
    grpo_temperature: float = 0.7
    """GRPO sampling temperature (at 1.0 the tiny SFT model's samples are mostly unformatted: a sparse reward)."""
    grpo_beta: float = 0.01
    """GRPO k3 KL coefficient to the SFT policy (lr 3e-4 without KL collapsed on 2 of 3 seeds)."""
    grpo_val_size: int = 30
    """GRPO validation items (the tasks' val split), scored every ``grpo_val_every`` steps."""
    grpo_val_every: int = 25
    """GRPO validation interval in steps."""
    max_new_tokens: int = 48
    """generation budget (rollouts and eval); the synthetic solutions are ~30-40 tokens."""
    eval_size: int = 500
    """held-out (test split) items per task for the three evaluations (1,500 paired items: an interval of
    about +-0.03 on the gain)."""
    eval_batch_size: int = 16
    """prompts per generate call in the evaluations."""

    @classmethod
    def tiny(cls) -> "QuickstartConfig":
        """A seconds-long smoke budget: the whole pipeline runs, nothing is expected to learn."""
        return cls(
            tasks=("count_shapes", "bar_chart"),
            model_size=dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
            corpus_items=10, sft_train_size=16, sft_batch_size=4, sft_steps=3, grpo_train_size=8,
            grpo_prompts_per_step=2, grpo_group_size=2, grpo_steps=2, grpo_val_size=2, grpo_val_every=1,
            max_new_tokens=8, eval_size=2, eval_batch_size=4,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmpo quickstart",
        description="Build a tiny VLM, evaluate, SFT warm-up, evaluate, GRPO, evaluate; print the table and "
        "save plots. About 3 minutes on 2 idle CPU cores (up to ~10 when they are busy); seconds with --tiny.",
    )
    parser.add_argument("--out", default="runs/quickstart", help="output directory (default: runs/quickstart)")
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run (checks plumbing, not learning)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, data and sampling")
    parser.add_argument("--kind", choices=("vlm", "text"), default="vlm",
                        help="vlm: a tiny Qwen2.5-VL on visual tasks (default); text: a tiny Qwen3 text LM on the "
                        "text task " + ",".join(TEXT_QUICKSTART_TASKS) + f" ({TEXT_QUICKSTART_GRPO_STEPS} GRPO steps)")
    parser.add_argument("--tasks", default=None, help="comma-separated synthetic tasks (default: "
                        + ",".join(QuickstartConfig().tasks) + "; with --kind text " + ",".join(TEXT_QUICKSTART_TASKS) + ")")
    parser.add_argument("--abstain-share", type=float, default=None,
                        help="share of the questions about red, blue or green (shapes, or the text task's items) "
                        "on which the SFT teacher abstains (default 0.8; 0: the plain teacher, on which the GRPO "
                        "gain is not shown)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT steps")
    parser.add_argument("--grpo-steps", type=int, default=None, help="override the GRPO steps")
    parser.add_argument("--eval-size", type=int, default=None, help="override held-out items per task")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: OMP_NUM_THREADS, else all cores)")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: move an existing --out aside to OUT.old-<time> (nothing is deleted)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def config_from_args(args: argparse.Namespace) -> QuickstartConfig:
    config = QuickstartConfig.tiny() if args.tiny else QuickstartConfig()
    overrides: dict[str, Any] = {}
    if args.kind == "text":  # the text task and its budget; the same abstaining teacher (0.8 of red/blue/green)
        overrides.update(kind="text", tasks=TEXT_QUICKSTART_TASKS)
        if not args.tiny:
            overrides["grpo_steps"] = TEXT_QUICKSTART_GRPO_STEPS
    if args.abstain_share is not None:
        overrides["sft_abstain_share"] = args.abstain_share
    if args.tasks:
        overrides["tasks"] = tuple(task.strip() for task in args.tasks.split(",") if task.strip())
    for name in ("sft_steps", "grpo_steps", "eval_size"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return replace(config, **overrides)


# ----------------------------------------------------------------------------- stages


def _done_marker(stage_dir: Path) -> Path:
    return stage_dir / "stage_done.json"


def _stage_finished(stage_dir: Path) -> dict[str, Any] | None:
    marker = _done_marker(stage_dir)
    return json.loads(marker.read_text()) if marker.is_file() else None


def _mark_finished(stage_dir: Path, info: dict[str, Any]) -> None:
    stage_dir.mkdir(parents=True, exist_ok=True)
    _done_marker(stage_dir).write_text(json.dumps(info, indent=2) + "\n")


def build_model(config: QuickstartConfig, out: Path, *, seed: int) -> Path:
    """Stage 1: the tiny Qwen2.5-VL, tokenizer trained on the chosen tasks' corpus."""
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_text_lm, build_tiny_vlm

    texts = corpus(list(config.tasks), n=config.corpus_items, seed=seed)
    if config.kind == "text":
        return build_tiny_text_lm(out / "model_init", seed=seed, corpus=texts, **config.model_size)
    return build_tiny_vlm(out / "model_init", seed=seed, corpus=texts, **config.model_size)


def evaluate_stage(
    model_path: Path, config: QuickstartConfig, out_dir: Path, *, seed: int, progress: bool
) -> dict[str, Any]:
    """Greedy accuracy on ``eval_size`` held-out items per task; reports written to ``out_dir``."""
    from mmpo.eval.harness import evaluate_checkpoint

    benchmarks = [f"synth/{task}" for task in config.tasks]
    return evaluate_checkpoint(
        model_path, benchmarks, greedy=True, max_new_tokens=config.max_new_tokens,
        batch_size=config.eval_batch_size, synth_size=config.eval_size, synth_seed=seed, seed=seed,
        out_dir=out_dir, progress=progress,
    )


def _trainer(stage_dir: Path, *, max_steps: int, progress: bool, val_every: int | None = None):
    """A CPU Lightning Trainer with a CSV logger and a checkpoint every few steps (and at the end).

    Checkpoints are verified and the one replaced is kept as ``last.prev.ckpt`` (the fallback when
    ``last.ckpt`` is damaged). Each run logs to the next free ``logs/version_N`` (a resume never
    overwrites the metrics logged before the interruption), flushed every step so that a hard kill
    loses none of the rows a checkpoint covers.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from mmpo.training.checkpoint import VerifiedCheckpointIO
    from mmpo.training.progress import StepProgressBar
    from mmpo.training.quiet import quiet_lightning_notices
    from mmpo.training.run_lock import RunDirectoryLock

    quiet_lightning_notices()
    checkpoint = ModelCheckpoint(dirpath=stage_dir / "checkpoints", save_last=True, save_top_k=0,
                                 every_n_train_steps=max(1, min(50, max_steps // 4 or 1)))
    return Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1,
        logger=CSVLogger(stage_dir, name="logs", flush_logs_every_n_steps=1),
        callbacks=[checkpoint, RunDirectoryLock(), *([StepProgressBar()] if progress else [])],
        plugins=[VerifiedCheckpointIO()],
        log_every_n_steps=1, enable_progress_bar=progress, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=stage_dir,
        val_check_interval=val_every, check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=None if val_every else 0,
    )


def _fit(trainer, module, datamodule, stage_dir: Path, *, validate_first: bool = False) -> None:
    """``trainer.fit``, resuming from ``checkpoints/last.ckpt`` when an earlier run was interrupted.

    A damaged ``last.ckpt`` falls back to ``last.prev.ckpt`` with a warning naming both.
    ``validate_first`` logs the validation metrics at step 0 (the start of the learning curve).
    """
    from mmpo.training.checkpoint import select_resume_checkpoint

    resume = select_resume_checkpoint(stage_dir / "checkpoints" / "last.ckpt")
    if resume is not None:
        print(f"[quickstart] resuming from {resume}")
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume))
        return
    if validate_first:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule)


def run_sft(model_path: Path, config: QuickstartConfig, stage_dir: Path, *, seed: int, progress: bool) -> Path:
    """Stage 3: SFT warm-up on rendered think/answer solutions; returns the HF export."""
    from mmpo.algos.sft import SFTModule
    from mmpo.data.demonstrations import AbstainingTeacherDataModule
    from mmpo.training.config import OptimConfig

    datamodule = AbstainingTeacherDataModule(
        abstain_colours=config.sft_abstain_colours, abstain_share=config.sft_abstain_share,
        tasks=list(config.tasks), train_size=config.sft_train_size, val_size=0, seed=seed,
        batch_size=config.sft_batch_size)
    # The module writes the HF export (output_dir) when fit ends.
    module = SFTModule(model_path=str(model_path), optim=OptimConfig(lr=config.sft_lr),
                       output_dir=str(stage_dir / "hf"), save_hf_on_checkpoint=False)
    trainer = _trainer(stage_dir, max_steps=config.sft_steps, progress=progress)
    _fit(trainer, module, datamodule, stage_dir)
    return stage_dir / "hf"


def run_grpo(model_path: Path, config: QuickstartConfig, stage_dir: Path, *, seed: int, progress: bool) -> Path:
    """Stage 4: GRPO with the default accuracy + format reward; returns the HF export."""
    from mmpo.algos.grpo import GRPOModule
    from mmpo.data.datamodule import PromptDataModule
    from mmpo.training.config import LossConfig, OptimConfig, SamplingConfig

    # seed + 1: other training prompts than SFT (the module and datamodule seeds must agree for Lightning).
    datamodule = PromptDataModule(tasks=list(config.tasks), train_size=config.grpo_train_size,
                                  val_size=config.grpo_val_size, seed=seed + 1,
                                  batch_size=config.grpo_prompts_per_step)
    # One rollout batch = one optimizer step (mu 1, whole-rollout minibatch), so max_steps counts batches.
    module = GRPOModule(model_path=str(model_path), optim=OptimConfig(lr=config.grpo_lr),
                        sampling=SamplingConfig(num_generations=config.grpo_group_size,
                                                temperature=config.grpo_temperature,
                                                max_new_tokens=config.max_new_tokens),
                        loss=LossConfig(beta=config.grpo_beta), seed=seed + 1, output_dir=str(stage_dir / "hf"))
    trainer = _trainer(stage_dir, max_steps=config.grpo_steps, progress=progress, val_every=config.grpo_val_every)
    _fit(trainer, module, datamodule, stage_dir, validate_first=True)
    return stage_dir / "hf"


# ----------------------------------------------------------------------------- reporting


def metrics_files(logs_dir: Path) -> list[Path]:
    """``logs/version_N/metrics.csv`` of a stage in version order (a run, then each resume)."""
    numbered = {path: path.parent.name.removeprefix("version_") for path in logs_dir.glob("version_*/metrics.csv")}
    return sorted((path for path, number in numbered.items() if number.isdigit()), key=lambda p: int(numbered[p]))


def accuracy_by_task(results: dict[str, Any]) -> dict[str, float]:
    """{task: accuracy, ..., "mean": mean over tasks} from ``evaluate_checkpoint`` results."""
    table = {name.split("/", 1)[1]: metrics["accuracy"] for name, metrics in results["benchmarks"].items()}
    table["mean"] = sum(table.values()) / len(table)
    return table


REWARD_CURVE_KEYS = ("rewards/total/mean", "rewards/accuracy/mean", "val/accuracy")


def item_correctness(eval_dir: Path) -> dict[str, float]:
    """``{benchmark/item id: 1.0 or 0.0}`` from an evaluation's ``predictions/*.jsonl`` (greedy: one sample)."""
    return {f"{benchmark}/{record['id']}": float(bool(record["correct"][0]))
            for benchmark, record in prediction_records(eval_dir)}


def prediction_records(eval_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(benchmark file stem, record)`` for every item of an evaluation's ``predictions/*.jsonl``."""
    return [(path.stem, json.loads(line)) for path in sorted((eval_dir / "predictions").glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def abstention_share(eval_dir: Path) -> float | None:
    """Share of an evaluation's completions that abstain (``mmpo.data.demonstrations``); None: not evaluated."""
    from mmpo.data.demonstrations import abstention_rate

    completions = [text for _benchmark, record in prediction_records(eval_dir) for text in record["completions"]]
    return abstention_rate(completions) if completions else None


def paired_gain(before: Mapping[str, float], after: Mapping[str, float], *, level: float = 0.95,
                n_boot: int = 4000, seed: int = 0) -> dict[str, Any]:
    """Mean of ``after - before`` over the items both scored, with a paired percentile bootstrap interval over
    the items (:func:`mmpo.eval.stats.paired_difference` with one seed), and whether it excludes zero."""
    from mmpo.eval.stats import paired_difference

    items = sorted(set(before) & set(after))
    if not items:
        raise ValueError("no held-out item was scored both before and after")
    result = paired_difference([[after[i] for i in items]], [[before[i] for i in items]], level=level,
                               n_boot=n_boot, seed=seed)
    low, high = result["bootstrap"]
    return {"items": len(items), "gain": result["estimate"], "interval": [low, high], "level": level,
            "shown": bool(low > 0 or high < 0)}


def reward_rise(csv_paths: Sequence[Path], key: str = "rewards/total/mean", share: float = 0.1) -> dict[str, Any] | None:
    """Mean of ``key`` over the first and the last ``share`` of the logged GRPO steps (None: not logged)."""
    values: list[float] = []
    for path in csv_paths:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get(key) not in (None, ""):
                    values.append(float(row[key]))
    if not values:
        return None
    width = max(1, round(len(values) * share))
    first, last = sum(values[:width]) / width, sum(values[-width:]) / width
    return {"key": key, "steps": len(values), "window": width, "first": first, "last": last}


def verdict_line(gain: Mapping[str, Any] | None) -> str:
    """The printed verdict: the gain with its interval, or "not shown" when the interval includes zero."""
    if gain is None:
        return "GRPO vs SFT: not measured."
    low, high = gain["interval"]
    stated = (f"{gain['gain']:+.3f} ({round(100 * gain['level'])}% paired bootstrap interval over the items "
              f"{low:+.3f} to {high:+.3f})")
    if not gain["shown"]:
        return f"GRPO vs SFT on {gain['items']} held-out items: {stated}: a gain is not shown."
    direction = "GRPO improved on the SFT model" if gain["gain"] > 0 else "GRPO is worse than the SFT model"
    return f"{direction} on {gain['items']} held-out items: {stated}."


def write_summary(out: Path, config: QuickstartConfig, stages: dict[str, dict[str, float]],
                  timings: dict[str, float], paths: dict[str, str], *, seed: int) -> dict[str, Any]:
    from mmpo.eval.plots import plot_accuracy_bars, plot_curves
    from mmpo.eval.reports import comparison_table, write_json

    table = comparison_table(stages)
    grpo_csvs = metrics_files(out / "grpo" / "logs")
    if grpo_csvs:
        paths["learning_curve"] = str(plot_curves(grpo_csvs, REWARD_CURVE_KEYS, out / "learning_curve.png",
                                                  title="GRPO: reward and validation accuracy"))
    paths["eval_plot"] = str(plot_accuracy_bars(stages, out / "eval.png", title="Held-out accuracy per task"))
    before, after = out / "eval" / "after_sft", out / "eval" / "after_grpo"
    gain = (paired_gain(item_correctness(before), item_correctness(after), seed=seed)
            if (before / "predictions").is_dir() and (after / "predictions").is_dir() else None)
    summary = {
        "config": asdict(config), "seed": seed, "accuracy": stages, "timings_s": timings, "paths": paths,
        "grpo_vs_sft": gain, "reward": reward_rise(grpo_csvs),
        "abstained": {stage: abstention_share(out / "eval" / name)
                      for stage, name in (("after SFT", "after_sft"), ("after GRPO", "after_grpo"))},
        # a gain only when the paired interval over the held-out items excludes zero
        "grpo_improved_over_sft": None if gain is None else bool(gain["shown"] and gain["gain"] > 0),
    }
    write_json(summary, out / "quickstart.json")
    (out / "results.md").write_text(
        "# mmpo quickstart\n\nGreedy accuracy on held-out synthetic items "
        f"({config.eval_size} per task, test split).\n\n{table}\n\nTimings (s): "
        + ", ".join(f"{name} {value:.0f}" for name, value in timings.items()) + "\n")
    return summary


# ----------------------------------------------------------------------------- main


def check_tasks(tasks: Sequence[str]) -> None:
    """Fail with the list of valid names when a task is unknown or none is given."""
    from mmpo.data.synthetic import TASKS

    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown or missing synthetic task(s) {unknown or list(tasks)}; valid: {list(TASKS)}")


def run_quickstart(config: QuickstartConfig, out: str | Path, *, seed: int = 0, progress: bool = True,
                   fresh: bool = False) -> dict[str, Any]:
    """Run the pipeline; returns the summary written to ``out/quickstart.json``."""
    from mmpo.training.run_lock import DirectoryLock

    check_tasks(config.tasks)
    out = Path(out)
    if fresh:
        moved = move_aside(out)
        if moved is not None:
            print(f"[quickstart] --fresh: moved the earlier {out} to {moved}")
    with DirectoryLock(out):
        return _run_stages(config, out, seed=seed, progress=progress)


def move_aside(out: Path) -> Path | None:
    """Rename an existing, non-empty ``out`` to ``OUT.old-<time>`` (never deleting); returns the new path.

    Takes ``out``'s lock first, so a run still writing it is never moved from under it.
    """
    from mmpo.training.run_lock import DirectoryLock

    out = out.absolute()  # "." has no name to suffix
    if not out.is_dir() or not any(out.iterdir()):
        return None
    with DirectoryLock(out):
        pass
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while target.exists():
        target, n = out.with_name(f"{out.name}.old-{stamp}-{n}"), n + 1
    os.replace(out, target)
    return target


def _run_stages(config: QuickstartConfig, out: Path, *, seed: int, progress: bool) -> dict[str, Any]:
    import lightning.pytorch as pl

    pl.seed_everything(seed, workers=True, verbose=False)
    # GRPO steps its optimizer manually and the checkpoint is meant to hold the post-step state,
    # which is exactly what Lightning's warning about manual optimization describes.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    stages: dict[str, dict[str, float]] = {}
    timings: dict[str, float] = {}
    paths: dict[str, str] = {}

    settings = {"config": asdict(config), "seed": seed}

    def stage(name: str, stage_dir: Path, work) -> dict[str, Any]:
        finished = _stage_finished(stage_dir)
        if finished is not None:
            if finished.get("settings") != json.loads(json.dumps(settings)):
                raise StaleOutputError(f"{stage_dir} was produced with other settings than this run's; "
                                       "pass --fresh to redo it or choose another --out")
            print(f"[quickstart] {name}: already done in {stage_dir}, reusing it")
            return finished
        print(f"[quickstart] {name} ...", flush=True)
        started = time.perf_counter()
        info = work()
        info["seconds"] = round(time.perf_counter() - started, 1)
        info["settings"] = settings
        _mark_finished(stage_dir, info)
        return info

    def eval_work(model_path: Path, stage_dir: Path):
        return lambda: {"accuracy": accuracy_by_task(
            evaluate_stage(model_path, config, stage_dir, seed=seed, progress=progress))}

    info = stage("build model", out / "model_init", lambda: {"path": str(build_model(config, out, seed=seed))})
    model_init, timings["build"] = Path(info["path"]), info["seconds"]

    before_dir = out / "eval" / "before_sft"
    info = stage("eval before SFT", before_dir, eval_work(model_init, before_dir))
    stages["before SFT"], timings["eval before SFT"] = info["accuracy"], info["seconds"]

    info = stage("SFT warm-up", out / "sft",
                 lambda: {"path": str(run_sft(model_init, config, out / "sft", seed=seed, progress=progress))})
    sft_path, timings["SFT"] = Path(info["path"]), info["seconds"]
    sft_dir = out / "eval" / "after_sft"
    info = stage("eval after SFT", sft_dir, eval_work(sft_path, sft_dir))
    stages["after SFT"], timings["eval after SFT"] = info["accuracy"], info["seconds"]

    info = stage("GRPO", out / "grpo",
                 lambda: {"path": str(run_grpo(sft_path, config, out / "grpo", seed=seed, progress=progress))})
    grpo_path, timings["GRPO"] = Path(info["path"]), info["seconds"]
    grpo_dir = out / "eval" / "after_grpo"
    info = stage("eval after GRPO", grpo_dir, eval_work(grpo_path, grpo_dir))
    stages["after GRPO"], timings["eval after GRPO"] = info["accuracy"], info["seconds"]

    paths.update(model_init=str(model_init), sft=str(sft_path), grpo=str(grpo_path))
    return write_summary(out, config, stages, timings, paths, seed=seed)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mmpo quickstart``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    config = config_from_args(args)
    try:
        check_tasks(config.tasks)
    except ValueError as error:
        print(f"mmpo quickstart: error: {error}", file=sys.stderr)
        return 2
    from mmpo.training.checkpoint import CorruptCheckpointError
    from mmpo.training.quiet import hf_progress_bars_off
    from mmpo.training.run_lock import RunDirectoryLockedError

    started = time.perf_counter()
    try:
        with hf_progress_bars_off():  # no "Loading weights" / "Writing model shards" bars between the stages' own
            summary = run_quickstart(config, args.out, seed=args.seed, progress=not args.no_progress,
                                     fresh=args.fresh)
    except (StaleOutputError, CorruptCheckpointError, RunDirectoryLockedError) as error:
        print(f"mmpo quickstart: error: {error}", file=sys.stderr)
        return 2
    from mmpo.eval.reports import comparison_table

    print("\nHeld-out accuracy (greedy) per task:\n")
    print(comparison_table(summary["accuracy"]))
    reward = summary.get("reward")
    if reward is not None:
        print(f"\nGRPO training reward ({reward['key']}), mean of the first / last {reward['window']} of "
              f"{reward['steps']} steps: {reward['first']:.3f} -> {reward['last']:.3f}")
    abstained = summary.get("abstained") or {}
    if summary["config"]["sft_abstain_share"] > 0 and None not in abstained.values():
        things = "items" if summary["config"]["kind"] == "text" else "shapes"
        print(f"Held-out answers that abstain (\"unsure\", as the SFT teacher did on "
              f"{summary['config']['sft_abstain_share']:.0%} of the questions about "
              f"{'/'.join(summary['config']['sft_abstain_colours'])} {things}): after SFT "
              f"{abstained['after SFT']:.0%}, after GRPO {abstained['after GRPO']:.0%}")
    print(f"\n{verdict_line(summary.get('grpo_vs_sft'))} "
          f"Total {time.perf_counter() - started:.0f} s. Outputs: {args.out}/ "
          "(results.md, quickstart.json, eval.png, learning_curve.png, sft/hf, grpo/hf)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
