"""Evidence benchmark for the VLM algorithms (issue 18): each method on a task where its mechanism can act.

Protocol (documented in ``bench/RESULTS.md``, section "VLM algorithms: evidence"):

- One tiny Qwen2.5-VL (the quickstart's size and corpus-trained tokenizer), one SFT start per
  experiment, then every algorithm of the experiment runs the same RL budget from that start with
  the same seeds (data order and sampling): ``--rl-steps`` steps x 8 prompts x G 8, lr 1e-4
  (geometry: lr 5e-5, temperature 0.7; its start is geometry_aux level 1 after 600 SFT steps).
- Four experiments, one per mechanism:

  ========== ============================= ============================= ===================================
  experiment start (SFT)                   algorithms                    mechanism metric
  ========== ============================= ============================= ===================================
  main       think-answer, 300 steps       GRPO, PAPO-G, MAPO            perception gap (real vs masked
             (count_shapes, compare_size,                                 image), perception-error share;
             bar_chart: mid accuracy)                                     MAPO's lambda / success fraction
  steps      "steps" style (R1-VL), same   GRPO (accuracy + StepRVR),    StepRAR key-step fraction,
             tasks                         StepGRPO (StepRAR + StepRVR)  StepRVR validity
  geometry   geometry_aux, SFT on a mix    GRPO, GCPO                    share of groups whose contrastive
             with / without the auxiliary                                 mask is non-zero; aux rate by kind
             construction
  weak       think-answer, 40 steps        GRPO, AHPO, TAPO              gate-open share, expert token share;
             (accuracy ~0)                                               all-wrong group share (every
                                                                         algorithm), TAPO's guided /
                                                                         unguided rewards
  ========== ============================= ============================= ===================================

- Held-out score: greedy accuracy on ``--eval-size`` test-split items per task (disjoint from the
  training items by content hash), every ``--eval-every`` RL steps (the learning curve) and at
  the end, plus at the end the sampled accuracy (``--eval-samples`` completions per item at the RL
  temperature). Every run stores per-item results (and the completions), so contrasts (algorithm -
  start, algorithm - GRPO) get a hierarchical paired bootstrap interval over seeds and items and a
  Student-t interval over the seed means (``bench/paired_intervals.py``).

Stages (each resumable; finished work is skipped)::

    python bench/bench_vlm_evidence.py starts --out runs/vlm_evidence          # SFT starts + their eval
    python bench/bench_vlm_evidence.py runs --out runs/vlm_evidence &  # RL runs: one worker per core,
    python bench/bench_vlm_evidence.py runs --out runs/vlm_evidence &  # sharing the jobs via claim files
    python bench/bench_vlm_evidence.py report --out runs/vlm_evidence          # tables + curve plot

Every run result is written atomically to ``OUT/runs/<experiment>__<algo>__s<seed>.json``; a worker that is
stopped leaves a claim whose process is gone, which the next worker takes over (the interrupted run is redone
from its start, with the same seeds). ``--algos`` picks some of each experiment's algorithms. TAPO's template
library is built by the starts stage from the weak start (``--tapo-seed-problems`` training-split problems per
task, the code of ``mmpo tapo-library``) into ``OUT/starts/sft_weak_tapo_library.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mmpo.eval.heldout import heldout_texts, sampled_accuracy  # noqa: E402
from mmpo.eval.stats import paired_difference, seed_t_interval  # noqa: E402
from mmpo.files import atomic_write_json, atomic_write_text  # noqa: E402

MAIN_TASKS = ("count_shapes", "compare_size", "bar_chart")
GEOMETRY_TASKS = ("geometry_aux",)
MODEL_SIZE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)
EVAL_SEED = 1234
MASK_SEED = 4321


@dataclass(frozen=True)
class Start:
    """One SFT start: tasks, solution style, steps; ``aux_mix`` > 0 mixes the geometry solutions;
    ``difficulty`` fixes the task level for SFT, RL and evaluation (None: levels 1-3 mixed)."""

    tasks: tuple[str, ...]
    style: str
    steps_arg: str
    aux_mix: float = 0.0
    difficulty: int | None = None


STARTS: dict[str, Start] = {
    "sft": Start(MAIN_TASKS, "think-answer", "sft_steps"),
    "sft_steps": Start(MAIN_TASKS, "steps", "sft_steps"),
    # level 1 (angles multiples of 10): at levels 1-3 mixed the tiny model reached only 0.08 after 300 SFT steps
    "sft_geo": Start(GEOMETRY_TASKS, "think-answer", "geo_sft_steps", aux_mix=0.5, difficulty=1),
    "sft_weak": Start(MAIN_TASKS, "think-answer", "weak_sft_steps"),
}


@dataclass(frozen=True)
class Experiment:
    """A start, the generation budget, the algorithms (module class, settings over the common ones) and,
    where the common RL settings do not suit the start, its own learning rate and sampling temperature."""

    start: str
    max_new_tokens: int
    algos: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    lr: float | None = None
    temperature: float = 1.0


GRPO = "mmpo.algos.grpo.GRPOModule"
STEPS_GRPO_REWARD = {"accuracy": 0.9, "step_rvr": 0.1}  # GRPO's accuracy + format, format = the steps layout
EXPERIMENTS: dict[str, Experiment] = {
    "main": Experiment("sft", 48, {
        "grpo": (GRPO, {}),
        # PAPO-G with the paper's double-entropy regulariser (eta 0.05, its 7B GRPO setting), which the
        # paper adds against KL_prcp hacking (section 5.3); run C of the earlier benchmark hacked without it
        "papo_g": ("mmpo.algos.papo.PAPOModule", {"gamma": 0.02, "eta_orig": 0.05, "eta_masked": 0.05}),
        "mapo": ("mmpo.algos.mapo.MAPOModule", {"advantage": {"name": "mapo"}}),
    }),
    "steps": Experiment("sft_steps", 96, {
        "grpo": (GRPO, {"system_prompt": "steps", "rewards": {"weights": STEPS_GRPO_REWARD}}),
        "stepgrpo": ("mmpo.algos.stepgrpo.StepGRPOModule", {"loss": {"beta": 0.04}}),
    }),
    # lr 5e-5 and temperature 0.7: at the common lr 1e-4 and temperature 1.0 (sampled accuracy 0.12 against
    # 0.36 greedy) both GRPO and GCPO collapsed to one answer on 2 of 2 seeds (bench/RESULTS.md)
    "geometry": Experiment("sft_geo", 96, {
        "grpo": (GRPO, {}),
        "gcpo": ("mmpo.algos.gcpo.GCPOModule", {"loss": {"beta": 0.0}}),
    }, lr=5e-5, temperature=0.7),
    # TAPO: its template library is built by the starts stage from the weak start on training-split problems
    # (mmpo.algos.tapo_cli.library_from_policy, the code of `mmpo tapo-library`); every other setting is GRPO's
    "weak": Experiment("sft_weak", 48, {
        "grpo": (GRPO, {}),
        "ahpo": ("mmpo.algos.ahpo.AHPOModule", {"loss": {"beta": 0.0}}),
        "tapo": ("mmpo.algos.tapo.TAPOModule", {"library": "<out>/starts/sft_weak_tapo_library.json"}),
    }),
}
OUT_MARK = "<out>/"  # a setting value starting with it is a file under --out (resolve_out_paths)
TAPO_CLASS = "mmpo.algos.tapo.TAPOModule"


# ----------------------------------------------------------------------------- data


def mix_auxiliary(row: dict[str, Any], seed: int, share: float) -> dict[str, Any]:
    """A geometry_aux training row whose solution uses the construction or not, flipped with prob ``share``.

    The reference solutions always construct for ``exterior`` and never for ``interior``, so an SFT
    policy never mixes and GCPO's contrastive mask stays 0. Flipped rows: an exterior solution
    without the construction goes the long way (interior angle 180 - a - b, then 180 minus it: two
    subtractions instead of one addition, so the construction really helps), and an interior one
    with it copies the angles first (same arithmetic, longer). The choice is a hash of the row id.
    """
    from mmpo.data.geometry_aux import AUXILIARY_CONSTRUCTION

    flip = (zlib.crc32(f"{seed}:{row['id']}".encode()) % 10_000) / 10_000 < share
    if not flip:
        return row
    steps = list(row["steps"])
    a, b = (int(word.rstrip(".")) for word in steps[0].split()[-3::2])
    if row["aux_helps"]:
        interior = 180 - a - b
        steps = [steps[0], f"The interior angle at C is 180 - {a} - {b} = {interior}.",
                 f"The exterior angle is 180 - {interior} = {a + b}."]
    else:
        steps = [steps[0], AUXILIARY_CONSTRUCTION, f"The parallel line copies angle A ({a}) and angle B ({b}) at C.",
                 *steps[1:]]
    row = dict(row, steps=steps)
    from mmpo.data.solution import render_solution

    row["expert_trace"] = render_solution(row)
    return row


def _datamodule(tasks: Sequence[str], *, train_size: int, seed: int, batch_size: int, aux_mix: float = 0.0,
                difficulty: int | None = None):
    from mmpo.data.datamodule import PromptDataModule

    class MixedAuxDataModule(PromptDataModule):
        def _synthetic(self, total: int, split: str):
            rows = super()._synthetic(total, split)
            if split != "train" or aux_mix <= 0:
                return rows
            return [mix_auxiliary(row, self.seed, aux_mix) if row["task"] == "geometry_aux" else row for row in rows]

    return MixedAuxDataModule(tasks=list(tasks), train_size=train_size, val_size=0, seed=seed, batch_size=batch_size,
                              difficulty=difficulty)


def eval_rows(tasks: Sequence[str], size: int, difficulty: int | None = None) -> list[dict[str, Any]]:
    import mmpo.data.geometry_aux  # noqa: F401  (registers geometry_aux)
    from mmpo.data.synthetic import make_items

    return [row for task in tasks for row in make_items(task, size, seed=EVAL_SEED, split="test", difficulty=difficulty)]


def masked_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with PAPO's masked image (p 0.6 of the 14 px cells blacked out), one fixed mask per row."""
    from mmpo.algos.papo import mask_seed, random_patch_blackening

    return [dict(row, images=[random_patch_blackening(image, seed=mask_seed(MASK_SEED, 0, str(row["id"])))
                              for image in row["images"]]) for row in rows]


# ----------------------------------------------------------------------------- scoring


def mentions(text: str, alternatives: Sequence[str]) -> bool:
    """Whether ``text`` contains one of ``alternatives`` as whole words (case-insensitive): "3 shapes"
    is found in "It shows 3 shapes." but not in "13 shapes"."""
    return any(re.search(rf"(?<!\w){re.escape(alt.strip())}(?!\w)", text, flags=re.IGNORECASE)
               for alt in ([alternatives] if isinstance(alternatives, str) else alternatives) if alt.strip())


# Which key steps of a task are readings of the image (the rest is reasoning on them): the shape count;
# both size readings; the bar's value (the bar count is perceptual too but not needed for the answer).
PERCEPTUAL_KEY_STEPS: dict[str, tuple[int, ...]] = {"count_shapes": (0,), "compare_size": (0, 1), "bar_chart": (1,)}


def perception_error(text: str, row: dict[str, Any], correct: bool) -> bool:
    """A wrong answer with a wrong image reading: one of the task's perceptual key steps
    (:data:`PERCEPTUAL_KEY_STEPS`, else the first) appears nowhere in the completion. False for correct
    answers; a wrong answer whose readings are all right is a reasoning error.

    The whole completion is searched (StepRAR's matcher reads only ``### Step`` sections, which the
    think-answer style has none of)."""
    key_steps = row.get("key_steps") or []
    if correct or not key_steps:
        return False
    perceptual = PERCEPTUAL_KEY_STEPS.get(str(row.get("task")), (0,))
    return any(not mentions(text, key_steps[k]) for k in perceptual if k < len(key_steps))


def score_texts(texts: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, list]:
    """Per-item correctness, key-step fraction, StepRVR validity, auxiliary use and perception errors."""
    from mmpo.rewards import accuracy_reward
    from mmpo.rewards.gcpo import uses_auxiliary
    from mmpo.rewards.step import key_step_match_fraction, step_rvr_reward

    texts, rows = list(texts), list(rows)
    correct = [bool(c) for c in accuracy_reward(texts, rows).tolist()]
    return {
        "texts": texts,
        "correct": correct,
        "key_step_frac": [key_step_match_fraction(t, r.get("key_steps") or []) for t, r in zip(texts, rows)],
        "step_valid": [bool(v) for v in step_rvr_reward(texts, rows).tolist()],
        "uses_aux": [bool(u) for u in uses_auxiliary(texts).tolist()],
        "perception_error": [perception_error(t, r, c) for t, r, c in zip(texts, rows, correct)],
    }


def generate_texts(model, processor, rows, *, system_prompt: str | None, max_new_tokens: int, samples: int = 0,
                   temperature: float = 1.0) -> list[str]:
    """Greedy completions (or ``samples`` sampled ones per row) on EVAL_SEED's draws (mmpo.eval.heldout)."""
    return heldout_texts(model, processor, rows, system_prompt=system_prompt, max_new_tokens=max_new_tokens,
                         samples=samples, temperature=temperature, seed=EVAL_SEED)


def evaluate(model, processor, rows, *, system_prompt, max_new_tokens, masked: Sequence | None = None,
             samples: int = 0, temperature: float = 1.0) -> dict:
    result = score_texts(generate_texts(model, processor, rows, system_prompt=system_prompt,
                                      max_new_tokens=max_new_tokens), rows)
    if samples > 0:
        result["sampled_accuracy"] = sampled_accuracy(model, processor, rows, system_prompt=system_prompt,
                                                      max_new_tokens=max_new_tokens, samples=samples,
                                                      temperature=temperature, seed=EVAL_SEED)
    if masked is not None:
        masked_scores = score_texts(generate_texts(model, processor, masked, system_prompt=system_prompt,
                                                 max_new_tokens=max_new_tokens), masked)
        result["correct_masked"], result["texts_masked"] = masked_scores["correct"], masked_scores["texts"]
    return result


def system_prompt_for_start(kind: str) -> str:
    from mmpo.data import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT

    return STEPS_SYSTEM_PROMPT if STARTS[kind].style == "steps" else SYSTEM_PROMPT


# ----------------------------------------------------------------------------- files


def run_path(out: Path, experiment: str, algo: str, seed: int) -> Path:
    return out / "runs" / f"{experiment}__{algo}__s{seed}.json"


def resolve_out_paths(settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """``settings`` with every string value that starts with ``<out>/`` (at any depth) made a path under ``out``."""
    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: resolve(item) for key, item in value.items()}
        if isinstance(value, str) and value.startswith(OUT_MARK):
            return str(out / value[len(OUT_MARK):])
        return value

    return resolve(settings)


def all_wrong_group_frac(rewards: Sequence[float], group_ids: Sequence[int]) -> float:
    """The share of groups whose every reward is <= 0 (no correct rollout: GRPO's advantage is 0 on them)."""
    groups: dict[int, bool] = {}
    for reward, gid in zip(rewards, group_ids):
        groups[int(gid)] = groups.get(int(gid), True) and float(reward) <= 0
    return sum(groups.values()) / len(groups) if groups else float("nan")


def with_group_counts(module_class: type) -> type:
    """``module_class`` logging ``evidence/all_wrong_group_frac`` each step (the same rule for every algorithm,
    TAPO's guided rollouts included); training is unchanged."""
    class Counted(module_class):
        def compute_rewards(self, rollout):
            rewards, metrics = super().compute_rewards(rollout)
            metrics["evidence/all_wrong_group_frac"] = all_wrong_group_frac(rewards.tolist(), rollout.group_ids.tolist())
            return rewards, metrics

    Counted.__name__ = Counted.__qualname__ = module_class.__name__
    return Counted


# ----------------------------------------------------------------------------- stages


def _trainer(root: Path, max_steps: int, callbacks: list) -> Any:
    import lightning as L

    from mmpo.training.quiet import quiet_lightning_notices

    quiet_lightning_notices()
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1,
        logger=L.pytorch.loggers.CSVLogger(root, name="logs", flush_logs_every_n_steps=10),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, log_every_n_steps=1, callbacks=callbacks,
    )


def build_init(out: Path) -> Path:
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_vlm

    init = out / "init"
    if not (init / "config.json").exists():
        import mmpo.data.geometry_aux  # noqa: F401

        texts = corpus([*MAIN_TASKS, *GEOMETRY_TASKS], n=200, seed=0)
        build_tiny_vlm(init, seed=0, corpus=texts, **MODEL_SIZE)
    return init


def build_start(kind: str, init: Path, out: Path, args: argparse.Namespace) -> Path:
    """SFT from ``init`` (quickstart settings: 600 items, 16 per step, lr 1e-3); cached."""
    import lightning as L

    from mmpo.algos.sft import SFTModule
    from mmpo.training.config import OptimConfig

    spec = STARTS[kind]
    target = out / "starts" / kind / "hf"
    if (target / "config.json").exists():
        return target
    L.seed_everything(0, verbose=False)
    data = _datamodule(spec.tasks, train_size=600, seed=0, batch_size=16, aux_mix=spec.aux_mix,
                       difficulty=spec.difficulty)
    module = SFTModule(model_path=str(init), optim=OptimConfig(lr=1e-3), style=spec.style,
                       output_dir=str(target), save_hf_on_checkpoint=False)
    t0 = time.perf_counter()
    steps = getattr(args, spec.steps_arg)
    _trainer(out / "starts" / kind, steps, []).fit(module, datamodule=data)
    print(f"[evidence] start {kind}: {steps} SFT steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def build_tapo_library(name: str, start_model: Path, args: argparse.Namespace) -> Path | None:
    """The experiment's TAPO library (if it runs TAPO), built once from its start with the code of
    ``mmpo tapo-library`` on ``--tapo-seed-problems`` training-split items per task (seed 0); cached."""
    from mmpo.algos.tapo_cli import library_from_policy, seed_problems
    from mmpo.vlm.factory import load_vlm

    experiment = EXPERIMENTS[name]
    tapo = [extra for algo, (path, extra) in experiment.algos.items() if path == TAPO_CLASS and algo in chosen_algos(args, name)]
    if not tapo:
        return None
    target = Path(resolve_out_paths(tapo[0], args.out)["library"])
    if target.exists():
        return target
    start = STARTS[experiment.start]
    rows = seed_problems(start.tasks, args.tapo_seed_problems, seed=0)
    model, processor = load_vlm(start_model)
    t0 = time.perf_counter()
    library = library_from_policy(model, processor, rows, samples=args.tapo_samples, max_depth=3, beam=2,
                                  max_new_tokens=experiment.max_new_tokens, temperature=experiment.temperature, seed=0)
    atomic_write_json(target, library)
    print(f"[evidence] {name}: TAPO library of {len(library['templates'])} template(s) from {len(rows)} seed problems "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return target


def stage_starts(args: argparse.Namespace) -> None:
    from mmpo.vlm.factory import load_vlm

    init = build_init(args.out)
    for name in chosen_experiments(args):
        experiment = EXPERIMENTS[name]
        kind = experiment.start
        path = build_start(kind, init, args.out, args)
        build_tapo_library(name, path, args)
        result_path = args.out / "starts" / f"{kind}.json"
        if result_path.exists():
            continue
        rows = eval_rows(STARTS[kind].tasks, args.eval_size, STARTS[kind].difficulty)
        model, processor = load_vlm(path)
        result = evaluate(model, processor, rows, system_prompt=system_prompt_for_start(kind),
                          max_new_tokens=experiment.max_new_tokens,
                          masked=masked_rows(rows) if name == "main" else None,
                          samples=args.eval_samples, temperature=experiment.temperature)
        result["tasks"] = [row["task"] for row in rows]
        atomic_write_json(result_path, result)
        print(f"[evidence] start {kind}: accuracy {statistics.mean(result['correct']):.3f}", flush=True)


def chosen_experiments(args: argparse.Namespace) -> list[str]:
    chosen = [name.strip() for name in args.experiments.split(",")] if args.experiments else list(EXPERIMENTS)
    unknown = [name for name in chosen if name not in EXPERIMENTS]
    if unknown:
        raise SystemExit(f"unknown experiment(s) {unknown}; valid: {list(EXPERIMENTS)}")
    return chosen


def chosen_algos(args: argparse.Namespace, name: str) -> list[str]:
    """The experiment's algorithms named in ``--algos`` (all of them without it)."""
    wanted = getattr(args, "algos", None)
    if not wanted:
        return list(EXPERIMENTS[name].algos)
    chosen = [algo.strip() for algo in wanted.split(",")]
    known = {algo for experiment in EXPERIMENTS.values() for algo in experiment.algos}
    unknown = [algo for algo in chosen if algo not in known]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}; valid: {sorted(known)}")
    return [algo for algo in EXPERIMENTS[name].algos if algo in chosen]


def jobs(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(experiment, algo, seed), seed-major so a cut-short run still covers every algorithm."""
    return [(name, algo, seed) for seed in range(args.seeds) for name in chosen_experiments(args)
            for algo in chosen_algos(args, name)]


def run_one(experiment: str, algo: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    import mmpo.rewards.step  # noqa: F401  (registers step_rvr, the steps-experiment GRPO's format reward)
    from mmpo.training.config import merged_settings

    spec = EXPERIMENTS[experiment]
    class_path, extra = spec.algos[algo]
    module_name, class_name = class_path.rsplit(".", 1)
    module_class = with_group_counts(getattr(__import__(module_name, fromlist=[class_name]), class_name))
    extra = resolve_out_paths(extra, args.out)
    start = STARTS[spec.start]
    rows = eval_rows(start.tasks, args.eval_size, start.difficulty)
    masked = masked_rows(rows) if experiment == "main" else None
    L.seed_everything(seed, verbose=False)
    settings = dict(sampling={"num_generations": 8, "max_new_tokens": spec.max_new_tokens,
                              "temperature": spec.temperature},
                    optim={"lr": spec.lr or args.rl_lr}, loss={"beta": 0.01, "clip_low": 0.2, "clip_high": 0.3},
                    rewards={"timeout_s": None}, seed=seed + 1)
    module = module_class(str(args.out / "starts" / spec.start / "hf"), **merged_settings(settings, extra))
    data = _datamodule(start.tasks, train_size=args.rl_steps * 8, seed=seed + 1, batch_size=8,
                       aux_mix=start.aux_mix, difficulty=start.difficulty)
    curve: dict[int, list[bool]] = {}

    class Curve(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if step % args.eval_every == 0 and step < args.rl_steps:
                curve[step] = evaluate(pl_module.model, pl_module.processor, rows, system_prompt=pl_module.system_prompt,
                                       max_new_tokens=spec.max_new_tokens)["correct"]

    root = args.out / "logs" / f"{experiment}__{algo}__s{seed}"
    t0 = time.perf_counter()
    _trainer(root, args.rl_steps, [Curve()]).fit(module, datamodule=data)
    train_s = time.perf_counter() - t0
    final = evaluate(module.model, module.processor, rows, system_prompt=module.system_prompt,
                     max_new_tokens=spec.max_new_tokens, masked=masked, samples=args.eval_samples,
                     temperature=spec.temperature)
    curve[args.rl_steps] = final["correct"]
    return {"experiment": experiment, "algo": algo, "seed": seed, "settings": {k: str(v) for k, v in settings.items()},
            "rl_steps": args.rl_steps, "train_s": train_s, "final": final, "tasks": [row["task"] for row in rows],
            "aux_helps": [bool(row.get("aux_helps")) for row in rows],
            "curve": {str(step): values for step, values in sorted(curve.items())},
            "train_metrics": training_metrics(root)}


def training_metrics(root: Path) -> dict[str, dict[str, float]]:
    """Mean of every logged column over the first and the last fifth of the steps."""
    files = sorted(root.glob("logs/version_*/metrics.csv"))
    if not files:
        return {}
    with files[-1].open() as handle:
        table = list(csv.DictReader(handle))
    result: dict[str, dict[str, float]] = {}
    for column in table[0].keys() if table else []:
        values = [float(row[column]) for row in table if row.get(column) not in (None, "")]
        if len(values) < 2 or column in ("epoch", "step"):
            continue
        fifth = max(1, len(values) // 5)
        result[column] = {"first": statistics.mean(values[:fifth]), "last": statistics.mean(values[-fifth:])}
    return result


def claim(path: Path) -> bool:
    """Atomically claim a run for this process (``<run>.claim`` created with O_EXCL, holding the pid), so several
    worker processes can share one job list. A claim whose process is gone (a stopped worker) is stale: it is
    removed and the run claimed again, so a restarted worker redoes the interrupted run and nothing finished is
    lost (each finished run is its own file)."""
    marker = path.with_name(path.name + ".claim")
    for _ in range(2):
        try:
            descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not claim_is_stale(marker):
                return False
            marker.unlink(missing_ok=True)
            continue
        os.write(descriptor, str(os.getpid()).encode())
        os.close(descriptor)
        return True
    return False


def claim_is_stale(marker: Path) -> bool:
    """Whether the claim's process no longer runs on this machine (an unreadable or empty claim is not stale:
    it may be being written)."""
    try:
        pid = int(marker.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def stage_runs(args: argparse.Namespace) -> None:
    index, count = (int(x) for x in args.shard.split("/"))
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    for number, (experiment, algo, seed) in enumerate(jobs(args)):
        path = run_path(args.out, experiment, algo, seed)
        if number % count != index or path.exists():
            continue
        if not (args.out / "starts" / f"{EXPERIMENTS[experiment].start}.json").exists():
            raise SystemExit(f"run the 'starts' stage first: {EXPERIMENTS[experiment].start} is missing")
        if not claim(path):
            continue
        result = run_one(experiment, algo, seed, args)
        atomic_write_json(path, result)
        path.with_name(path.name + ".claim").unlink(missing_ok=True)
        print(f"[evidence] {experiment} {algo} seed {seed}: accuracy {statistics.mean(result['final']['correct']):.3f}"
              f" ({result['train_s']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- report


def _interval(summary: dict[str, Any]) -> str:
    low, high = summary["bootstrap"]
    t_low, t_high = summary["seed_t"]
    verdict = "excludes 0" if (low > 0 or high < 0) else "includes 0"
    return f"{summary['estimate']:+.3f} [{low:+.3f}, {high:+.3f}] (seed-t [{t_low:+.3f}, {t_high:+.3f}]; {verdict})"


def _mean(values: Sequence) -> float:
    return float(statistics.mean(float(v) for v in values)) if len(values) else float("nan")


def load_runs(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted((out / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        grouped.setdefault((run["experiment"], run["algo"]), []).append(run)
    for runs in grouped.values():
        runs.sort(key=lambda run: run["seed"])
    return grouped


def _metric(run: dict[str, Any], name: str, when: str = "last") -> float:
    return run["train_metrics"].get(name, {}).get(when, float("nan"))


def report(out: Path) -> str:
    grouped = load_runs(out)
    lines = ["# VLM algorithms evidence", ""]
    for name, experiment in EXPERIMENTS.items():
        start_path = out / "starts" / f"{experiment.start}.json"
        if not start_path.exists():
            continue
        start = json.loads(start_path.read_text())
        tasks = list(dict.fromkeys(start["tasks"]))
        lines += [f"## {name} (start {experiment.start})", "",
                  "| algo | seeds | " + " | ".join(tasks) + " | all | vs start, 95% CI | vs GRPO, 95% CI |",
                  "|---" * (len(tasks) + 5) + "|"]

        def per_task(correct: Sequence, task: str) -> float:
            return _mean([c for c, t in zip(correct, start["tasks"]) if t == task])

        lines.append(f"| start | - | " + " | ".join(f"{per_task(start['correct'], t):.3f}" for t in tasks)
                     + f" | {_mean(start['correct']):.3f} | | |")
        grpo_runs = {run["seed"]: run for run in grouped.get((name, "grpo"), [])}
        for algo in experiment.algos:
            runs = grouped.get((name, algo), [])
            if not runs:
                continue
            finals = [run["final"]["correct"] for run in runs]
            cells = [f"{_mean([per_task(f, t) for f in finals]):.3f}" for t in tasks]
            vs_start = _interval(paired_difference(finals, [start["correct"]] * len(finals))) if len(runs) > 1 else "-"
            paired = [(run["final"]["correct"], grpo_runs[run["seed"]]["final"]["correct"]) for run in runs
                      if run["seed"] in grpo_runs]
            vs_grpo = (_interval(paired_difference([a for a, _ in paired], [b for _, b in paired]))
                       if algo != "grpo" and len(paired) > 1 else "-")
            lines.append(f"| {algo} | {len(runs)} | " + " | ".join(cells)
                         + f" | {_mean([_mean(f) for f in finals]):.3f} | {vs_start} | {vs_grpo} |")
        lines += ["", *sampled_accuracy_lines(name, experiment, start, grouped),
                  *rollout_accuracy_lines(name, experiment, grouped), *mechanism_lines(name, experiment, start, grouped),
                  ""]
        lines += curve_lines(name, experiment, start, grouped)
    return "\n".join(lines) + "\n"


def sampled_accuracy_lines(name: str, experiment: Experiment, start: dict, grouped) -> list[str]:
    """Held-out sampled accuracy (avg@k at the experiment's temperature) vs the start and vs GRPO, for the
    algorithms whose every run has it."""
    if "sampled_accuracy" not in start:
        return []
    lines = []
    grpo = {run["seed"]: run for run in grouped.get((name, "grpo"), [])}
    for algo in experiment.algos:
        runs = grouped.get((name, algo), [])
        if len(runs) < 2 or any("sampled_accuracy" not in run["final"] for run in runs):
            continue
        finals = [run["final"]["sampled_accuracy"] for run in runs]
        line = (f"- {algo}: held-out sampled accuracy {_mean([_mean(f) for f in finals]):.3f} (start "
                f"{_mean(start['sampled_accuracy']):.3f}), vs start {_interval(paired_difference(finals, [start['sampled_accuracy']] * len(runs)))}")
        paired = [(run["final"]["sampled_accuracy"], grpo[run["seed"]]["final"].get("sampled_accuracy"))
                  for run in runs if run["seed"] in grpo]
        if algo != "grpo" and len(paired) > 1 and all(b is not None for _, b in paired):
            line += f", vs GRPO {_interval(paired_difference([a for a, _ in paired], [b for _, b in paired]))}"
        lines.append(line)
    return lines


def rollout_accuracy_lines(name: str, experiment: Experiment, grouped) -> list[str]:
    """Sampled accuracy of the rollouts, first vs last fifth of the run. Every RL prompt is new (one
    epoch of ``rl_steps`` x 8 fresh training items), so this is accuracy on prompts the policy had not
    seen, at the sampling temperature; the interval is Student-t over the seeds' changes."""
    lines = []
    for algo in experiment.algos:
        runs = [run for run in grouped.get((name, algo), []) if "rewards/accuracy/mean" in run["train_metrics"]]
        if len(runs) < 2:
            continue
        first = [_metric(run, "rewards/accuracy/mean", "first") for run in runs]
        last = [_metric(run, "rewards/accuracy/mean") for run in runs]
        low, high = seed_t_interval([b - a for a, b in zip(first, last)])
        lines.append(f"- {algo}: rollout accuracy on new prompts {_mean(first):.3f} -> {_mean(last):.3f} (first -> last "
                     f"fifth), change {_mean(last) - _mean(first):+.3f}, seed-t [{low:+.3f}, {high:+.3f}]")
    return lines


def mechanism_lines(name: str, experiment: Experiment, start: dict, grouped) -> list[str]:
    lines: list[str] = []
    algos = [algo for algo in experiment.algos if grouped.get((name, algo))]
    if name == "main":
        rows = eval_rows(STARTS[experiment.start].tasks, len(start["correct"]) // len(set(start["tasks"])),
                         STARTS[experiment.start].difficulty)

        def perception_flags(result: dict) -> list[bool]:
            """Per item, from the stored texts (the rule as it is now, not as it was at run time)."""
            return [perception_error(t, r, c) for t, r, c in zip(result["texts"], rows, result["correct"])]

        def perception_share(result: dict) -> float:
            """Perception errors / errors."""
            return sum(perception_flags(result)) / max(1, len(result["correct"]) - sum(result["correct"]))

        grpo_by_seed = {run["seed"]: run for run in grouped.get((name, "grpo"), [])}

        gap = _mean(start["correct"]) - _mean(start["correct_masked"])
        share = perception_share(start)
        lines.append(f"- start: accuracy with the masked image {_mean(start['correct_masked']):.3f}, perception gap "
                     f"{gap:+.3f}; perception errors {share:.3f} of the errors")
        for algo in algos:
            runs = grouped[(name, algo)]
            gaps = [_mean(r["final"]["correct"]) - _mean(r["final"]["correct_masked"]) for r in runs]
            shares = [perception_share(r["final"]) for r in runs]
            gap_ci = paired_difference([[a - b for a, b in zip(r["final"]["correct"], r["final"]["correct_masked"])]
                               for r in runs], [[0.0] * len(start["correct"])] * len(runs))
            extra = ""
            if algo == "papo_g":
                extra = (f"; KL_prcp {_mean([_metric(r, 'papo/kl_prcp', 'first') for r in runs]):.3f} -> "
                         f"{_mean([_metric(r, 'papo/kl_prcp') for r in runs]):.3f}, H(orig) "
                         f"{_mean([_metric(r, 'papo/entropy_orig', 'first') for r in runs]):.3f} -> "
                         f"{_mean([_metric(r, 'papo/entropy_orig') for r in runs]):.3f}")
            if algo == "mapo":
                extra = (f"; lambda mean {_mean([_metric(r, 'mapo/lambda_mean', 'first') for r in runs]):.3f} -> "
                         f"{_mean([_metric(r, 'mapo/lambda_mean') for r in runs]):.3f}, success fraction "
                         f"{_mean([_metric(r, 'mapo/success_frac', 'first') for r in runs]):.3f} -> "
                         f"{_mean([_metric(r, 'mapo/success_frac') for r in runs]):.3f}")
            # the paper counts perception errors (-30.5% vs GRPO): per item, a perception error or not, paired
            rates = [perception_flags(r["final"]) for r in runs]
            paired = [(flags, perception_flags(grpo_by_seed[r["seed"]]["final"])) for flags, r in zip(rates, runs)
                      if r["seed"] in grpo_by_seed]
            rate = (f"perception-error rate {_mean([_mean(f) for f in rates]):.3f} of the items (start "
                    f"{_mean(perception_flags(start)):.3f})")
            if algo != "grpo" and len(paired) > 1:
                rate += f", vs GRPO {_interval(paired_difference([a for a, _ in paired], [b for _, b in paired]))}"
            lines.append(f"- {algo}: perception gap {_mean(gaps):+.3f} ({_interval(gap_ci)}), perception errors "
                         f"{_mean(shares):.3f} of the errors (per seed {', '.join(f'{s:.2f}' for s in shares)}); "
                         f"{rate}{extra}")
    elif name == "steps":
        lines.append(f"- start: key-step fraction {_mean(start['key_step_frac']):.3f}, StepRVR valid "
                     f"{_mean(start['step_valid']):.3f}")
        for algo in algos:
            runs = grouped[(name, algo)]
            key_ci = paired_difference([r["final"]["key_step_frac"] for r in runs], [start["key_step_frac"]] * len(runs))
            lines.append(f"- {algo}: held-out key-step fraction {_mean([_mean(r['final']['key_step_frac']) for r in runs]):.3f}"
                         f" (vs start {_interval(key_ci)}), StepRVR valid "
                         f"{_mean([_mean(r['final']['step_valid']) for r in runs]):.3f}")
    elif name == "geometry":
        helps = [bool(h) for h in grouped[(name, algos[0])][0]["aux_helps"]] if algos else []

        def aux_rate(result: dict, flag: bool) -> float:
            return _mean([u for u, h in zip(result["uses_aux"], helps) if h is flag])

        if helps:
            lines.append(f"- start: uses the construction on {aux_rate(start, True):.3f} of exterior and "
                         f"{aux_rate(start, False):.3f} of interior held-out items")
        for algo in algos:
            runs = grouped[(name, algo)]
            extra = ""
            if algo == "gcpo":
                nonzero = [1 - _metric(r, "gcpo/mask_zero_frac", when) for r in runs for when in ("first", "last")]
                extra = (f"; contrastive mask non-zero for {_mean(nonzero[0::2]):.3f} -> {_mean(nonzero[1::2]):.3f} of "
                         f"the groups (first -> last fifth), one side empty "
                         f"{_mean([_metric(r, 'gcpo/one_side_empty_frac', 'first') for r in runs]):.3f} -> "
                         f"{_mean([_metric(r, 'gcpo/one_side_empty_frac') for r in runs]):.3f}")
            lines.append(f"- {algo}: uses the construction on {_mean([aux_rate(r['final'], True) for r in runs]):.3f} "
                         f"of exterior and {_mean([aux_rate(r['final'], False) for r in runs]):.3f} of interior items"
                         f"{extra}")
    elif name == "weak":
        lines += weak_group_lines(name, algos, grouped)
    if name == "weak" and "ahpo" in algos:
        runs = grouped[(name, "ahpo")]
        lines.append(f"- ahpo: gate open {_mean([_metric(r, 'ahpo/gate_on_frac', 'first') for r in runs]):.3f} -> "
                     f"{_mean([_metric(r, 'ahpo/gate_on_frac') for r in runs]):.3f} of the prompts, expert token share "
                     f"{_mean([_metric(r, 'ahpo/off_policy_token_share', 'first') for r in runs]):.3f} -> "
                     f"{_mean([_metric(r, 'ahpo/off_policy_token_share') for r in runs]):.3f} (first -> last fifth)")
    return lines


def weak_group_lines(name: str, algos: Sequence[str], grouped) -> list[str]:
    """All-wrong group fraction (first -> last fifth of the steps) per algorithm, its change vs GRPO paired by
    seed (Student-t over the seeds, last fifth), and TAPO's guided / unguided rollout rewards."""
    lines: list[str] = []
    key = "evidence/all_wrong_group_frac"
    grpo = {run["seed"]: _metric(run, key) for run in grouped.get((name, "grpo"), []) if key in run["train_metrics"]}
    for algo in algos:
        runs = [run for run in grouped[(name, algo)] if key in run["train_metrics"]]
        if not runs:
            continue
        line = (f"- {algo}: all-wrong groups {_mean([_metric(r, key, 'first') for r in runs]):.3f} -> "
                f"{_mean([_metric(r, key) for r in runs]):.3f} (first -> last fifth, {len(runs)} seeds)")
        paired = [_metric(r, key) - grpo[r["seed"]] for r in runs if r["seed"] in grpo]
        if algo != "grpo" and len(paired) > 1:
            low, high = seed_t_interval(paired)
            line += f", last fifth vs GRPO {_mean(paired):+.3f} seed-t [{low:+.3f}, {high:+.3f}]"
        if algo == "tapo":
            line += (f"; guided reward {_mean([_metric(r, 'tapo/guided_reward_mean', 'first') for r in runs]):.3f} -> "
                     f"{_mean([_metric(r, 'tapo/guided_reward_mean') for r in runs]):.3f}, unguided "
                     f"{_mean([_metric(r, 'tapo/unguided_reward_mean', 'first') for r in runs]):.3f} -> "
                     f"{_mean([_metric(r, 'tapo/unguided_reward_mean') for r in runs]):.3f}, groups all wrong without "
                     f"the guided rollouts {_mean([_metric(r, 'tapo/unguided_all_wrong_group_frac') for r in runs]):.3f}"
                     " (last fifth)")
        lines.append(line)
    return lines


def curve_lines(name: str, experiment: Experiment, start: dict, grouped) -> list[str]:
    lines: list[str] = []
    for algo in experiment.algos:
        runs = grouped.get((name, algo), [])
        if len(runs) < 2:
            continue
        steps = sorted({int(s) for run in runs for s in run["curve"]})
        cells = []
        for step in steps:
            finished = [run["curve"][str(step)] for run in runs if str(step) in run["curve"]]
            summary = paired_difference(finished, [start["correct"]] * len(finished), n_boot=1000)
            low, high = summary["bootstrap"]
            cells.append(f"{step}: {_mean([_mean(f) for f in finished]):.3f} ({summary['estimate']:+.3f} "
                         f"[{low:+.3f}, {high:+.3f}])")
        lines.append(f"- curve {algo} (step: accuracy (vs start, 95% CI)): " + "; ".join(cells))
    return lines + ([""] if lines else [])


def plot(out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = load_runs(out)
    names = [n for n in EXPERIMENTS if (out / "starts" / f"{EXPERIMENTS[n].start}.json").exists()]
    if not names:
        return None
    figure, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for axis, name in zip(axes[0], names):
        start = json.loads((out / "starts" / f"{EXPERIMENTS[name].start}.json").read_text())
        for algo in EXPERIMENTS[name].algos:
            runs = grouped.get((name, algo), [])
            if not runs:
                continue
            steps = sorted({int(s) for run in runs for s in run["curve"]})
            means, lows, highs = [], [], []
            for step in steps:
                per_seed = [_mean(run["curve"][str(step)]) for run in runs if str(step) in run["curve"]]
                mean = statistics.mean(per_seed)
                spread = 1.96 * statistics.stdev(per_seed) / len(per_seed) ** 0.5 if len(per_seed) > 1 else 0.0
                means.append(mean), lows.append(mean - spread), highs.append(mean + spread)
            axis.plot([0, *steps], [_mean(start["correct"]), *means], label=f"{algo} ({len(runs)} seeds)")
            axis.fill_between(steps, lows, highs, alpha=0.2)
        axis.set_title(f"{name} (start {EXPERIMENTS[name].start})")
        axis.set_xlabel("RL step")
        axis.set_ylabel("held-out greedy accuracy (band: ±1.96 SE over seeds)", fontsize=7)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    path = out / "vlm_evidence_curves.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["starts", "runs", "report"])
    parser.add_argument("--out", type=Path, default=Path("runs/vlm_evidence"))
    parser.add_argument("--experiments", default=None, help="comma-separated subset of " + ",".join(EXPERIMENTS))
    parser.add_argument("--algos", default=None, help="comma-separated subset of each experiment's algorithms")
    parser.add_argument("--tapo-seed-problems", type=int, default=4,
                        help="training-split seed problems per task for the TAPO library (built by the starts stage)")
    parser.add_argument("--tapo-samples", type=int, default=4, help="completions per scored node of the TAPO search")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the main and steps starts")
    parser.add_argument("--geo-sft-steps", type=int, default=600, help="SFT steps of the geometry start")
    parser.add_argument("--weak-sft-steps", type=int, default=40, help="SFT steps of the weak start")
    parser.add_argument("--rl-steps", type=int, default=200)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--eval-size", type=int, default=100, help="held-out items per task")
    parser.add_argument("--eval-every", type=int, default=50, help="RL steps between held-out evaluations")
    parser.add_argument("--eval-samples", type=int, default=8,
                        help="sampled completions per held-out item for the sampled accuracy (0: greedy only)")
    parser.add_argument("--shard", default="0/1", help="I/N: run every N-th job starting at I; workers started on the "
                        "same --out also share the job list through claim files")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "starts":
        stage_starts(args)
    elif args.stage == "runs":
        stage_runs(args)
    else:
        text = report(args.out)
        atomic_write_text(args.out / "summary.md", text)
        figure = plot(args.out)
        print(text + (f"\nplot: {figure}" if figure else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
