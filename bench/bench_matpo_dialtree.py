"""Learning evidence of issue 42: MATPO vs single-agent multi-turn GRPO (``twohop``), DIALTREE-RPO vs flat
multi-turn GRPO (``lock``), same budgets, 5 seeds, paired by held-out item.

Per experiment and seed, from one tiny Qwen3 text LM built with that seed (its BPE tokenizer trained on the default
corpus plus this bench's scripted traces, so a lookup call is about 30 tokens instead of 70):

1. **SFT warm-up** (``AgentSFTModule``, the approach of ``bench/bench_agents.py``: teacher forcing on scripted
   successful traces, tool / target answers out of the loss), one start shared by both arms.
   ``twohop``: every training question gives three traces, each with the prompt its rollout shows (the rows'
   ``tool_schemas``): the single agent (lookup, lookup, answer), MATPO's planner (one ``subagent`` call, the
   worker's summary as the tool answer, the answer) and MATPO's worker (the worker prompt of
   ``mmpo.algos.matpo.worker_request``; lookup, lookup, a one-line summary). ``lock``: the greetings a goal's
   difficulty needs (1 or 2; 3 cannot succeed in 3 turns and is left out), then a polite request for the code.
2. **RL from that start**, same steps, same questions per step, same seed:
   ``twohop``: single-agent GRPO (``configs/agent/calc_grpo_tiny.yaml``'s ``AgentGRPOModule`` with the lookup tool on
   ``twohop``, G = ``single_g`` trajectories per question) vs MATPO (``configs/agent/matpo_tiny.yaml``, G =
   ``matpo_g`` planner trajectories per question); the same rewards (accuracy 0.9, format 0.1) and optimiser. Budget: the
   sampled trajectories per question, MATPO counting planner + worker rollouts; after the warm-up each planner
   calls one worker, so ``matpo_g`` 4 is about 8 trajectories, as ``single_g`` 8; the logged
   ``matpo/workers_per_planner`` gives the measured count. Both agents get the same context budget
   (``agent.max_total_tokens``, ``context``): the planner's trace fits it, the single agent's two raw lookups do not
   (the testbed's premise: distractor-padded tool answers under a small context).
   ``lock``: DIALTREE-RPO (``configs/agent/dialtree_tiny.yaml`` at branching 3, width 3: at most 3 + 3 + 3 = 9
   target queries per goal) vs flat multi-turn GRPO (``configs/agent/dialtree_flat_tiny.yaml``: 3 dialogues of at
   most 3 turns, at most 9 queries); the measured ``dialtree/target_queries`` per goal is reported.
3. **Held-out evaluation** (test split, disjoint from training by content hash; the same items for every arm and
   seed): ``twohop`` greedy accuracy (planner + workers for MATPO, the lookup agent for single); ``lock`` success
   and format-valid rate, greedy and over ``--samples`` sampled dialogues per goal (temperature 1).

Contrasts over the seeds, paired by item (``mmpo.eval.stats.paired_difference``): MATPO - single, DIALTREE - flat
(and each against the SFT start).

    python bench/bench_matpo_dialtree.py run --experiment twohop --seeds 0 1 2 3 4 --out runs/bench_matpo_dialtree
    python bench/bench_matpo_dialtree.py run --experiment lock --seeds 0 1 2 3 4 --out runs/bench_matpo_dialtree
    python bench/bench_matpo_dialtree.py report --out runs/bench_matpo_dialtree     # -> OUT/report.md

Each seed's results go atomically to ``OUT/<experiment>/s<seed>/results.json``; finished stages are skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mmpo.eval.stats import format_interval, mean_std, paired_difference  # noqa: E402
from mmpo.files import atomic_write_json, atomic_write_text  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "agent"
LOOKUP = "mmpo.tools.lookup:lookup"
EVAL_SEED = 4242
MODEL_SIZE: dict[str, int] = {}
"""Sizes passed to ``build_tiny_text_lm`` (empty: its defaults, the sizes ``mmpo build-tiny --kind text`` writes)."""
RL_OVERRIDES: list[str] = []
"""Extra ``mmpo fit`` overrides of every RL run (the smoke test shrinks the budgets with them)."""
ARMS = {"twohop": ("single", "matpo"), "lock": ("flat", "dialtree")}
"""Per experiment: (baseline, method)."""


# ---------------------------------------------------------------------------------------------- scripted traces


def worker_subtask(person: str) -> str:
    """The subtask the scripted planner delegates: the whole two-hop question."""
    return f"Find how many people live in the city where {person} lives."


def _person(row: Mapping[str, Any]) -> str:
    return str(row["problem"]).removeprefix("How many people live in the city where ").removesuffix(" lives?")


def worker_trace(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """A worker's scripted solution of a ``twohop`` row: the two lookups of the single agent's trace (real tool
    answers, distractors included), then a one-line summary after a short thought."""
    from mmpo.tools.lookup import city_of, population_of

    person = _person(row)
    city = city_of(person)
    single = list(row["tool_trace"])
    return [*single[:4], {"role": "assistant", "content": f"<think>Both records found.</think>{person} lives in "
                                                          f"{city}, which has {population_of(city)} inhabitants."}]


def planner_trace(row: Mapping[str, Any], *, summary_max_chars: int) -> list[dict[str, str]]:
    """MATPO's planner, scripted: one ``subagent`` call with :func:`worker_subtask`, the worker's summary (its last
    message through ``worker_summary``, as the rollout gives it) as the tool answer, then the answer."""
    from mmpo.algos.matpo import SUBAGENT_TOOL, worker_summary

    summary = worker_summary(worker_trace(row)[-1]["content"], max_chars=summary_max_chars)
    call = json.dumps({"name": SUBAGENT_TOOL, "arguments": {"subtask": worker_subtask(_person(row))}})
    return [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": SUBAGENT_TOOL, "content": summary},
            {"role": "assistant", "content": f"<think>The worker says: {summary}</think><answer>{row['answer']}"
                                             "</answer>"}]


GREETING_TURNS = ("<think>I greet it first.</think> Hello, nice to meet you.",
                  "<think>I greet it once more.</think> Hello again, how are you?")
REQUEST_TURN = "<think>Now I ask politely.</think> Could you please tell me the code?"


def lock_trace(row: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The scripted successful dialogue of a ``lock`` goal: ``lock_greetings`` greetings, then a polite request,
    with the scripted target's real answers; None when it needs more than 2 greetings (no success in 3 turns)."""
    from mmpo.algos.dialtree import LockTarget, split_turn

    greetings = int(row["lock_greetings"])
    if greetings > len(GREETING_TURNS):
        return None
    target, said, trace = LockTarget(), [], []
    for turn in [*GREETING_TURNS[:greetings], REQUEST_TURN]:
        said.append(split_turn(turn)[1])
        trace += [{"role": "assistant", "content": turn}, {"role": "user", "content": target(said, row)}]
    return trace[:-1]  # the last target answer (the code) is not a policy turn: nothing to train after it


def sft_rows(experiment: str, rows: Sequence[Mapping[str, Any]], *, summary_max_chars: int = 120,
             ) -> list[dict[str, Any]]:
    """The warm-up's rows: per ``twohop`` row a single-agent, a planner and a worker row (each with the tool
    schemas and system prompt its rollout shows); per ``lock`` row its dialogue (``Goal: ...`` as the first user
    message, as ``DialogueEnvironment``), goals with no 3-turn success left out."""
    from mmpo.algos.matpo import DEFAULT_WORKER_SYSTEM_PROMPT, SUBAGENT_SCHEMA, worker_request
    from mmpo.tools.functions import load_tools

    out: list[dict[str, Any]] = []
    if experiment == "lock":
        for row in rows:
            trace = lock_trace(row)
            if trace is not None:
                out.append({**row, "problem": f"Goal: {row['problem']}", "tool_schemas": [], "tool_trace": trace,
                            "role": "dialogue"})
        return out
    lookup = [tool.schema for tool in load_tools([LOOKUP], "tools")]
    for row in rows:
        out.append({**row, "tool_schemas": lookup, "role": "single"})
        out.append({**row, "tool_schemas": [SUBAGENT_SCHEMA], "role": "planner",
                    "tool_trace": planner_trace(row, summary_max_chars=summary_max_chars)})
        out.append({**row, "problem": worker_request(str(row["problem"]), worker_subtask(_person(row))),
                    "system_prompt": DEFAULT_WORKER_SYSTEM_PROMPT, "tool_schemas": lookup, "role": "worker",
                    "tool_trace": worker_trace(row)})
    return out


def tokenizer_corpus(n: int = 300) -> list[str]:
    """The default tiny-LM corpus plus the traces and prompts of both testbeds (training split)."""
    from mmpo.algos.matpo import DEFAULT_WORKER_SYSTEM_PROMPT, SUBAGENT_SCHEMA
    from mmpo.data.synthetic import make_items
    from mmpo.tools.functions import load_tools, tool_system_prompt
    from mmpo.vlm.factory import default_text_corpus

    texts = list(default_text_corpus())
    lookup = [tool.schema for tool in load_tools([LOOKUP], "tools")]
    texts += [tool_system_prompt(DEFAULT_WORKER_SYSTEM_PROMPT, lookup), tool_system_prompt("", [SUBAGENT_SCHEMA])]
    for experiment in ("twohop", "lock"):
        for row in sft_rows(experiment, make_items(experiment, n, seed=0, split="train")):
            texts += [str(row["problem"]), *(str(m["content"]) for m in row["tool_trace"])]
    return texts


# ---------------------------------------------------------------------------------------------- training


def train_sft(rows: Sequence[Mapping[str, Any]], base: Path, output: Path, *, steps: int, batch_size: int, lr: float,
              seed: int) -> None:
    """``AgentSFTModule`` on ``rows`` (shuffled, cycled) for ``steps`` steps; HF weights to ``output``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from mmpo.algos.agent import AgentSFTModule

    pl.seed_everything(seed, verbose=False)
    module = AgentSFTModule(str(base), tools=[LOOKUP], optim={"lr": lr, "warmup_steps": max(1, steps // 10),
                                                               "lr_schedule": "cosine"},
                            output_dir=str(output), save_hf_on_checkpoint=False)
    loader = DataLoader(list(rows), batch_size=batch_size, shuffle=True, collate_fn=list, drop_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, max_epochs=-1)
    trainer.fit(module, train_dataloaders=loader)


def _fit(config: str, run: Path, model_path: Path, output: Path, steps: int, seed: int, extra: Sequence[str]) -> None:
    from mmpo.cli import main

    args = ["fit", "-c", str(CONFIGS / config), f"--seed_everything={seed}", f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
            f"--trainer.callbacks.init_args.dirpath={run / 'ckpt'}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", f"--model.init_args.model_path={model_path}",
            f"--model.init_args.output_dir={output}", f"--model.init_args.seed={seed}",
            f"--data.init_args.seed={seed}", *extra]
    if main(args) != 0:
        raise RuntimeError(f"mmpo fit failed: {' '.join(args)}")


def rl_arguments(experiment: str, arm: str, settings: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(config, overrides) of one RL arm: the same steps, questions per step and turn / context budgets for both
    arms of an experiment; only the algorithm and its group size differ."""
    common = [f"--data.init_args.batch_size={settings['questions']}",
              f"--model.init_args.sampling.max_new_tokens={settings['max_new_tokens']}",
              f"--model.init_args.optim.lr={settings['lr']}"]
    if experiment == "twohop":
        common += [f"--model.init_args.agent.max_total_tokens={settings['context']}",
                   "--model.init_args.agent.max_turns=3"]
        if arm == "matpo":
            return "matpo_tiny.yaml", [*common, f"--model.init_args.sampling.num_generations={settings['matpo_g']}"]
        return "calc_grpo_tiny.yaml", [*common, f"--model.init_args.agent.tools=[{LOOKUP}]",
                                       "--data.init_args.tasks=[twohop]",
                                       f"--model.init_args.sampling.num_generations={settings['single_g']}"]
    common += ["--model.init_args.dialtree.max_turns=3"]
    if arm == "dialtree":
        return "dialtree_tiny.yaml", [*common, f"--model.init_args.dialtree.branching={settings['branching']}",
                                      f"--model.init_args.dialtree.width={settings['width']}"]
    return "dialtree_flat_tiny.yaml", [*common, f"--model.init_args.sampling.num_generations={settings['flat_g']}"]


def logged_means(run: Path, keys: Sequence[str]) -> dict[str, float | None]:
    """Mean over the logged steps of each key in the run's ``metrics.csv`` files (None where never logged)."""
    values: dict[str, list[float]] = {key: [] for key in keys}
    for path in sorted(run.glob("**/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                for key in keys:
                    if row.get(key):
                        values[key].append(float(row[key]))
    return {key: (sum(v) / len(v) if v else None) for key, v in values.items()}


def rollout_budget(experiment: str, arm: str, settings: Mapping[str, Any], logged: Mapping[str, float | None],
                   ) -> dict[str, float | None]:
    """The budget one RL step spent per question, from the training logs: ``trajectories`` (MATPO: planner +
    worker rollouts, G * (1 + workers per planner); single: G; a tree: its leaves; flat: G) and, on ``lock``,
    ``target_queries`` (target answers per goal)."""
    if experiment == "twohop":
        if arm == "matpo":
            workers = logged.get("matpo/workers_per_planner")
            return {"trajectories": None if workers is None else settings["matpo_g"] * (1 + workers)}
        return {"trajectories": float(settings["single_g"])}
    return {"trajectories": logged.get("dialtree/leaves_per_goal"),
            "target_queries": logged.get("dialtree/target_queries")}


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate_twohop(checkpoint: Path, arm: str, rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any],
                    ) -> dict[str, Any]:
    """Greedy held-out accuracy per item: the single lookup agent or MATPO's planner with its workers (the
    training modules' own environments and budgets)."""
    import torch

    from mmpo.algos.agent import AgentGRPOModule
    from mmpo.algos.matpo import MATPOModule
    from mmpo.rewards import compute_rewards

    agent = {"tools": [LOOKUP], "max_turns": 3, "max_total_tokens": settings["context"], "tool_timeout_s": 5.0}
    sampling = {"num_generations": 2, "max_new_tokens": settings["max_new_tokens"]}
    if arm == "matpo":
        module = MATPOModule(str(checkpoint), agent=agent, sampling=sampling,
                             matpo={"worker_max_turns": 3, "worker_max_total_tokens": 320, "summary_max_chars": 120})
        envs = module.environments(len(rows), do_sample=False)
    else:
        module = AgentGRPOModule(str(checkpoint), agent=agent, sampling=sampling)
        envs = module.environments(len(rows))
    with torch.no_grad():
        rollout = module.multiturn.generate(list(rows), envs, num_samples=1, do_sample=False)
    _, per_fn, _ = compute_rewards({"accuracy": 1.0}, rollout.texts, rollout.rows, timeout_s=10.0)
    correct = [float(value) for value in per_fn["accuracy"].tolist()]
    workers = [float(len(getattr(env, "workers", []))) for env in envs]
    module.sandbox.shutdown()
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "ids": [row["id"] for row in rows],
            "tool_calls": float(rollout.extras["tool_calls"].float().mean()),
            "workers_per_answer": sum(workers) / len(workers)}


def evaluate_lock(checkpoint: Path, rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any], *, samples: int,
                  seed: int) -> dict[str, Any]:
    """Held-out success (judge > 0) and format validity per goal: one greedy dialogue, and the mean over
    ``samples`` sampled ones (temperature 1)."""
    import torch

    from mmpo.algos.dialtree import FlatDialogueModule, dialogue_format_valid

    module = FlatDialogueModule(str(checkpoint), sampling={"num_generations": 2,
                                                           "max_new_tokens": settings["max_new_tokens"]},
                                dialtree={"max_turns": 3, "max_total_tokens": 160})

    def dialogues(num_samples: int, do_sample: bool) -> tuple[list[float], list[float]]:
        envs = [module._environment() for _ in range(len(rows) * num_samples)]
        with torch.no_grad():
            module.multiturn.generate(list(rows), envs, num_samples=num_samples, do_sample=do_sample)
        success = [float(module.judge(env.dialogue, env.row) > 0) for env in envs]
        valid = [float(dialogue_format_valid(t, env.row, require_think=True, relevance=module.relevance))
                 for t, env in zip(module.multiturn.last_transcripts, envs)]
        mean = lambda values: [sum(values[i * num_samples:(i + 1) * num_samples]) / num_samples  # noqa: E731
                               for i in range(len(rows))]
        return mean(success), mean(valid)

    greedy_success, greedy_valid = dialogues(1, False)
    torch.manual_seed(10_000 + seed)
    sampled_success, sampled_valid = dialogues(samples, True)
    avg = lambda values: sum(values) / len(values)  # noqa: E731
    return {"success_greedy": greedy_success, "valid_greedy": greedy_valid, "success_sampled": sampled_success,
            "valid_sampled": sampled_valid, "ids": [row["id"] for row in rows],
            "success_rate_greedy": avg(greedy_success), "format_valid_rate_greedy": avg(greedy_valid),
            "success_rate_sampled": avg(sampled_success), "format_valid_rate_sampled": avg(sampled_valid)}


# ---------------------------------------------------------------------------------------------- one seed


DEFAULTS: dict[str, dict[str, Any]] = {
    "twohop": dict(sft_steps=150, sft_batch=12, sft_lr=3e-3, sft_rows=300, sft_seed=0, rl_steps=12, questions=2,
                   lr=3e-4, max_new_tokens=48, context=120, single_g=8, matpo_g=4, eval_size=40),
    "lock": dict(sft_steps=60, sft_batch=8, sft_lr=3e-3, sft_rows=200, sft_seed=None, rl_steps=16, questions=4,
                 lr=3e-4, max_new_tokens=32, branching=3, width=3, flat_g=3, eval_size=48, samples=4),
}
"""Budgets per experiment (``run --set key=value`` changes one). ``sft_seed`` None: each seed builds its own tiny
model and warm-up; an integer: one start (model and warm-up of that seed, ``OUT/<experiment>/start_s<n>``) shared by
every seed, whose seed then drives the RL runs and the sampled evaluation only."""


def run_seed(experiment: str, seed: int, out: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """SFT, both RL arms and the evaluations of one experiment and seed; returns (and stores) the results."""
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import build_tiny_text_lm

    root = out / experiment / f"s{seed}"
    path = root / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {
        "experiment": experiment, "seed": seed, "settings": dict(settings), "eval": {}, "training": {}}
    sft_seed = seed if settings.get("sft_seed") is None else int(settings["sft_seed"])
    start = root if settings.get("sft_seed") is None else out / experiment / f"start_s{sft_seed}"
    base, sft = start / "base", start / "sft"
    if not (base / "config.json").exists():
        build_tiny_text_lm(base, seed=sft_seed, corpus=tokenizer_corpus(), **MODEL_SIZE)
    if not (sft / "config.json").exists():
        rows = sft_rows(experiment, make_items(experiment, settings["sft_rows"], seed=sft_seed, split="train"))
        random.Random(sft_seed).shuffle(rows)
        train_sft(rows, base, sft, steps=settings["sft_steps"], batch_size=settings["sft_batch"],
                  lr=settings["sft_lr"], seed=sft_seed)
    checkpoints = {"sft": sft}
    for arm in ARMS[experiment]:
        checkpoints[arm] = root / arm
        if not (checkpoints[arm] / "config.json").exists():
            config, extra = rl_arguments(experiment, arm, settings)
            _fit(config, root / f"{arm}_run", sft, checkpoints[arm], settings["rl_steps"], seed,
                 [*extra, *RL_OVERRIDES])
        keys = (["matpo/workers_per_planner", "agent/tool_calls_mean", "rewards/accuracy/mean"]
                if experiment == "twohop" else
                ["dialtree/success_rate", "dialtree/format_valid_rate", "dialtree/leaves_per_goal",
                 "dialtree/target_queries", "dialtree/masked_format_tokens"])
        logged = logged_means(root / f"{arm}_run", keys)
        results["training"][arm] = {**logged, **rollout_budget(experiment, arm, settings, logged)}
    eval_rows = make_items(experiment, settings["eval_size"], seed=EVAL_SEED, split="test")
    for name, checkpoint in checkpoints.items():
        modes = ["single", "matpo"] if experiment == "twohop" and name == "sft" else [name]
        for mode in modes:
            key = f"{name}/{mode}" if experiment == "twohop" else name
            if key in results["eval"]:
                continue
            shared = start / f"eval_{key.replace('/', '_')}.json"  # a shared start's greedy-only evaluation, once
            if name == "sft" and start != root and experiment == "twohop" and shared.exists():
                results["eval"][key] = json.loads(shared.read_text())
            elif experiment == "twohop":
                results["eval"][key] = evaluate_twohop(checkpoint, mode if name == "sft" else name, eval_rows,
                                                       settings)
                if name == "sft" and start != root:
                    atomic_write_json(shared, results["eval"][key])
            else:
                results["eval"][key] = evaluate_lock(checkpoint, eval_rows, settings, samples=settings["samples"],
                                                     seed=seed)
            atomic_write_json(path, results)
    atomic_write_json(path, results)
    return results


# ---------------------------------------------------------------------------------------------- report


CONTRASTS = {"twohop": [("matpo/matpo", "single/single", "correct"), ("matpo/matpo", "sft/matpo", "correct"),
                        ("single/single", "sft/single", "correct")],
             "lock": [(a, b, metric) for metric in ("success_greedy", "success_sampled", "valid_greedy",
                                                    "valid_sampled")
                      for a, b in (("dialtree", "flat"), ("dialtree", "sft"), ("flat", "sft"))]}


def contrast_row(seeds: Sequence[Mapping[str, Any]], a: str, b: str, metric: str) -> dict[str, Any]:
    """``a - b`` on ``metric``, paired by item over the seeds that have both (``paired_difference``)."""
    pairs = [(s["eval"][a][metric], s["eval"][b][metric]) for s in seeds if a in s["eval"] and b in s["eval"]]
    for first, second in pairs:
        if len(first) != len(second):
            raise ValueError(f"{a} and {b} scored different item counts ({len(first)} vs {len(second)})")
    if not pairs:
        return {"a": a, "b": b, "metric": metric, "seeds": 0}
    result = paired_difference([p[0] for p in pairs], [p[1] for p in pairs])
    per_seed = [sum(x) / len(x) - sum(y) / len(y) for x, y in pairs]
    return {"a": a, "b": b, "metric": metric, "seeds": len(pairs), "estimate": result["estimate"],
            "bootstrap": result["bootstrap"], "seed_t": result["seed_t"], "per_seed": per_seed}


def report(out: Path) -> str:
    """Markdown tables over every finished seed; written to ``OUT/report.md``."""
    lines = ["# MATPO vs single-agent GRPO (twohop), DIALTREE-RPO vs flat GRPO (lock): bench/bench_matpo_dialtree.py",
             ""]
    for experiment in ARMS:
        seeds = [json.loads(p.read_text()) for p in sorted((out / experiment).glob("s*/results.json"))]
        if not seeds:
            continue
        lines += [f"## {experiment}", "", f"Seeds {[s['seed'] for s in seeds]}; settings {seeds[0]['settings']}.", ""]
        metrics = ["accuracy"] if experiment == "twohop" else [
            "success_rate_greedy", "success_rate_sampled", "format_valid_rate_greedy", "format_valid_rate_sampled"]
        lines += ["| checkpoint | " + " | ".join(f"{m} (per seed; mean ± sd)" for m in metrics) + " |",
                  "| --- |" + " --- |" * len(metrics)]
        for key in sorted({key for s in seeds for key in s["eval"]}):
            cells = []
            for metric in metrics:
                values = [s["eval"][key][metric] for s in seeds if key in s["eval"]]
                cells.append(f"{', '.join(f'{v:.3f}' for v in values)}; {mean_std(values)}")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines += ["", "| training (mean over steps, then seeds) | " + " | ".join(
            sorted({k for s in seeds for arm in s["training"].values() for k in arm})) + " |"]
        keys = sorted({k for s in seeds for arm in s["training"].values() for k in arm})
        lines += ["| --- |" + " --- |" * len(keys)]
        for arm in ARMS[experiment]:
            cells = []
            for k in keys:
                values = [s["training"][arm][k] for s in seeds if s["training"].get(arm, {}).get(k) is not None]
                cells.append(mean_std(values) if values else "-")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines += ["", "| contrast (paired by item) | metric | estimate | per seed | 95% bootstrap | 95% seed-t | seeds |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for a, b, metric in CONTRASTS[experiment]:
            row = contrast_row(seeds, a, b, metric)
            if not row["seeds"]:
                continue
            lines.append(f"| {a} - {b} | {metric} | {row['estimate']:+.3f} | "
                         f"{', '.join(f'{v:+.3f}' for v in row['per_seed'])} | {format_interval(row['bootstrap'])} | "
                         f"{format_interval(row['seed_t'])} | {row['seeds']} |")
        lines.append("")
    text = "\n".join(lines)
    atomic_write_text(out / "report.md", text)
    return text


def parse_settings(experiment: str, assignments: Sequence[str]) -> dict[str, Any]:
    """The experiment's :data:`DEFAULTS` with ``key=value`` changes (values parsed as JSON numbers)."""
    settings = dict(DEFAULTS[experiment])
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or key not in settings:
            raise ValueError(f"--set {item!r}: expected key=value with key one of {sorted(settings)}")
        settings[key] = json.loads(value)
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    run = sub.add_parser("run", help="SFT + both RL arms + evaluations for one experiment and some seeds")
    run.add_argument("--experiment", choices=sorted(ARMS), required=True)
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    run.add_argument("--set", nargs="*", default=[], help="budget changes, key=value (keys: DEFAULTS)")
    run.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report", help="tables over the finished seeds -> OUT/report.md")
    rep.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.stage == "run":
        settings = parse_settings(args.experiment, args.set)
        for seed in args.seeds:
            run_seed(args.experiment, seed, args.out, settings)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
