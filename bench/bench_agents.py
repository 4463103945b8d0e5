"""Learning evidence for tool use (issue 39): SFT on tool traces, then RL with the tools, on the tool tasks.

Per task and seed, from one tiny model built with that seed:

1. SFT: ``configs/agent/<task>_sft_tiny.yaml`` for ``--sft-steps`` steps (calc, codebook: the tiny Qwen3 text LM;
   zoom: the tiny Qwen2.5-VL). The tiny LMs of codebook and calc have their tokenizer trained with the tool-use
   texts as well (``mmpo.vlm.factory.tool_task_corpus``: a codebook trace in 305 tokens instead of 700), calc's
   with one token per digit (``individual_digits``: a number is the same digit tokens in the prompt, the
   calculator call and the result).
2. RL from that SFT start, ``--rl-steps`` steps each, same seed: GRPO (``configs/agent/<task>_grpo_tiny.yaml``)
   and, on calc and codebook, ARPO (``configs/agent/arpo_tiny.yaml``, ``codebook_arpo_tiny.yaml``) at the same
   rollout budget (8 trajectories per prompt).
3. Held-out evaluation of the SFT start and of each RL result, greedy, on ``--eval-size`` test-split items
   (disjoint from training by content hash; the same items for every checkpoint and seed), twice: with the task's
   tool (multi-turn, ``mmpo eval --tools``) and without tools (one turn).

Contrasts reported over the seeds, paired by item (``mmpo.eval.stats.paired_difference``: hierarchical bootstrap over
seeds and items, and a Student-t interval over the seed means): RL with tools - RL without tools; RL with tools - SFT
with tools; ARPO - GRPO (with tools); plus the tool-call rate, tool calls and turns per answer at evaluation and the
tool calls per trajectory during training (``agent/tool_calls_mean``). On a task with ARPO, also ARPO - GRPO in
tool calls per item at evaluation (paired by item) and, paired by step, in tool calls per trained trajectory, tool calls
the sandbox executed per step (an ARPO branch's shared prefix counted once: the paper's tool-call budget) and batch
accuracy (``codebook_pair``: the codes of two keys, so the number of calls is the model's choice).

Stages (each resumable: finished work is skipped)::

    python bench/bench_agents.py run --task calc --seeds 0 1 2 3 4 --out runs/bench_agents
    python bench/bench_agents.py run --task zoom --seeds 0 1 2 3 4 --out runs/bench_agents
    python bench/bench_agents.py run --task codebook_pair --seeds 0 1 2 3 4 --sft-start SFT_DIR --out runs/bench_agents
    python bench/bench_agents.py report --out runs/bench_agents      # -> OUT/report.md

The tiny VLM's reading of zoom's digit (bench/RESULTS.md, "Tool use on zoom"): ``--task zoom_digit_read`` /
``zoom_digit_box_read`` are reading probes (the image is the crop, the answer its digit; SFT them, then ``diagnose``);
``--sft-aux-task zoom_digit_box_read`` mixes such rows into a zoom task's SFT warm-up (auxiliary data, equal shares);
``--model-size KEY=INTEGER`` (repeatable) changes the tiny model the SFT starts from, e.g. ``min_pixels=12544`` (the
pixel budget's minimum at its maximum: ``zoom_digit_box``'s 28 x 28 crop is seen enlarged to 112 x 112)::

    python bench/bench_agents.py run --task zoom_digit_box --model-size min_pixels=12544 \
        --sft-aux-task zoom_digit_box_read --seeds 0 1 2 3 4 --sft-steps 300 --rl-steps 20 --eval-size 50 --out OUT

RL from SFT checkpoints made elsewhere (codebook's start needs two SFT runs, see bench/RESULTS.md): ``--sft-start
DIR`` (one start for every seed) or ``--sft-start runs/s{seed}/sft`` (each seed's own); ``--rl-lr`` and
``--rl-override KEY=VALUE`` (repeatable) change every RL run.

Each seed's results go atomically to ``OUT/<task>/s<seed>/results.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mmpo.eval.stats import format_interval, mean_std, paired_difference  # noqa: E402
from mmpo.files import atomic_write_json, atomic_write_text  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "agent"
TASKS = {
    "calc": dict(kind="text", tools=["calculator"], max_new_tokens=96, algos={"grpo": "calc_grpo_tiny.yaml", "arpo": "arpo_tiny.yaml"},
                 sft="calc_sft_tiny.yaml", tool_tokenizer=True, individual_digits=True),
    "codebook": dict(kind="text", tools=["codebook"], max_new_tokens=48,
                     algos={"grpo": "codebook_grpo_tiny.yaml", "arpo": "codebook_arpo_tiny.yaml"},
                     sft="codebook_sft_tiny.yaml", tool_tokenizer=True),
    "codebook_pair": dict(kind="text", tools=["codebook"], max_new_tokens=48,
                          algos={"grpo": "codebook_pair_grpo_tiny.yaml", "arpo": "codebook_pair_arpo_tiny.yaml"},
                          sft="codebook_pair_sft_tiny.yaml", tool_tokenizer=True),
    "zoom": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=128, algos={"grpo": "zoom_grpo_tiny.yaml"},
                 sft="zoom_sft_tiny.yaml"),
    # zoom's configs on the zoom_digit variant (one digit; the tool tokenizer: a 42-token call, each box
    # coordinate one token), with budgets that fit it: 64 tokens a turn, 160 a trajectory (16 of them the crop's)
    "zoom_digit": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64,
                       algos={"grpo": "zoom_grpo_tiny.yaml"}, sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                       overrides=["--data.init_args.tasks=[zoom_digit]"],
                       rl_overrides=["--model.init_args.agent.max_total_tokens=160"]),
    # the same, the question naming the red box's cell (the call copies it; the digit is still read from the crop)
    "zoom_digit_at": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64,
                          algos={"grpo": "zoom_grpo_tiny.yaml"}, sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                          overrides=["--data.init_args.tasks=[zoom_digit_at]"],
                          rl_overrides=["--model.init_args.agent.max_total_tokens=160"]),
    # the box named in the question is a 28 x 28 square around the digit; with a model whose min_pixels is its
    # max_pixels (--model-size min_pixels=12544) the crop is seen enlarged 4x, the glyph over several patches
    "zoom_digit_box": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64,
                           algos={"grpo": "zoom_grpo_tiny.yaml"}, sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                           overrides=["--data.init_args.tasks=[zoom_digit_box]"],
                           rl_overrides=["--model.init_args.agent.max_total_tokens=160"]),
    # reading probes: the image is the crop of a zoom_digit_at / zoom_digit_box item, the answer its digit, no tool
    # call (SFT and diagnose; as --sft-aux-task, auxiliary rows of the zoom SFT warm-up)
    "zoom_digit_read": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64, algos={},
                            sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                            overrides=["--data.init_args.tasks=[zoom_digit_read]"]),
    "zoom_digit_box_read": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64, algos={},
                                sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                                overrides=["--data.init_args.tasks=[zoom_digit_box_read]"]),
    # the red box filled with one of four fine textures that all average to one grey at the 112 x 112 view (the
    # question names the box's cell; the crop shows the stripes 1:1); the reading probe: the image is the crop
    "zoom_texture": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64,
                         algos={"grpo": "zoom_grpo_tiny.yaml"}, sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                         overrides=["--data.init_args.tasks=[zoom_texture]"],
                         rl_overrides=["--model.init_args.agent.max_total_tokens=160"]),
    "zoom_texture_read": dict(kind="vlm", tools=["image_zoom_in_tool"], max_new_tokens=64, algos={},
                              sft="zoom_sft_tiny.yaml", tool_tokenizer=True,
                              overrides=["--data.init_args.tasks=[zoom_texture_read]"]),
}
MODEL_SIZE: dict[str, dict[str, int]] = {"text": {}, "vlm": {}}
"""Sizes passed to the tiny builders (empty: their defaults, the sizes ``mmpo build-tiny`` writes)."""
EVAL_SEED = 1234
TOOL_LIMITS = dict(max_turns=3, max_total_tokens=320)
"""Turn and token budgets of the evaluation with tools (a task in :data:`TASK_TOOL_LIMITS` has its own)."""
TASK_TOOL_LIMITS: dict[str, dict[str, int]] = {"codebook_pair": dict(max_turns=5, max_total_tokens=448)}
"""codebook_pair: the budgets of its RL configs (two calls, a redundant one and one more)."""
SFT_OVERRIDES: list[str] = []
RL_OVERRIDES: list[str] = []
"""Extra ``mmpo fit`` overrides of every SFT / RL run (the smoke test shrinks the budgets with them)."""


def _fit(config: str, run: Path, model_path: Path, output: Path, steps: int, seed: int, extra: Sequence[str]) -> None:
    from mmpo.cli import main

    args = ["fit", "-c", str(CONFIGS / config), f"--seed_everything={seed}", f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
            f"--trainer.callbacks.init_args.dirpath={run / 'ckpt'}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", f"--model.init_args.model_path={model_path}",
            f"--model.init_args.output_dir={output}", *extra]
    if main(args) != 0:
        raise RuntimeError(f"mmpo fit failed: {' '.join(args)}")


def _evaluate(checkpoint: Path, task: str, tools: Sequence[str] | None, eval_size: int, max_new_tokens: int,
              out: Path, split: str = "test") -> dict[str, Any]:
    """Greedy accuracy of ``checkpoint`` on ``eval_size`` items of ``split`` (``test``: held out; ``val``: for
    choosing settings), with ``tools`` (multi-turn) or without (one turn); per item: correct, id, difficulty."""
    from mmpo.data.synthetic import make_items
    from mmpo.eval.harness import ToolUse, evaluate_checkpoint

    tool_use = ToolUse(tuple(tools), **TASK_TOOL_LIMITS.get(task, TOOL_LIMITS)) if tools else None
    results = evaluate_checkpoint(checkpoint, [f"synth/{task}"], synth_size=eval_size, synth_seed=EVAL_SEED,
                                  synth_split=split, max_new_tokens=max_new_tokens, out_dir=out, progress=False,
                                  device="cpu", tool_use=tool_use)
    metrics = results["benchmarks"][f"synth/{task}"]
    records = [json.loads(line) for line in (out / "predictions" / f"synth_{task}.jsonl").read_text().splitlines()]
    levels = {row["id"]: row["difficulty"] for row in make_items(task, eval_size, seed=EVAL_SEED, split=split)}
    summary = {"accuracy": metrics["accuracy"], "correct": [float(record["correct"][0]) for record in records],
               "ids": [record["id"] for record in records],
               "difficulty": [levels[record["id"]] for record in records]}
    for key in ("tool_call_rate", "tool_calls_per_answer", "turns_per_answer"):
        if key in metrics:
            summary[key] = metrics[key]
    if tools:
        summary["tool_calls"] = [float(record["tool_calls"][0]) for record in records]
    return summary


def _training_tool_calls(run: Path) -> float | None:
    """Mean of the logged ``agent/tool_calls_mean`` over the RL steps (tool calls per trajectory)."""
    values = _training_curves(run)["tool_calls_per_trajectory"]
    return sum(values) / len(values) if values else None


def _training_curves(run: Path) -> dict[str, list[float]]:
    """Per RL step, from the run's ``metrics.csv``: ``tool_calls_per_trajectory`` (``agent/tool_calls_mean``: the
    calls in each trained trajectory, a branch's inherited ones included), ``executed_tool_calls`` (the sum of every
    ``tools/<name>/calls``: the calls the sandbox ran in the step, so an ARPO branch's shared prefix counts once, and
    unparseable calls count under ``invalid``), ``turns_per_trajectory`` and ``batch_accuracy``
    (``rewards/accuracy/mean``, sampled at the training temperature); steps in order."""
    curves: dict[str, list[float]] = {"tool_calls_per_trajectory": [], "executed_tool_calls": [],
                                      "turns_per_trajectory": [], "batch_accuracy": []}
    for path in sorted(run.glob("**/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if not row.get("agent/tool_calls_mean"):
                    continue
                curves["tool_calls_per_trajectory"].append(float(row["agent/tool_calls_mean"]))
                curves["executed_tool_calls"].append(sum(float(value) for key, value in row.items()
                                                         if key.startswith("tools/") and key.endswith("/calls")
                                                         and value))
                curves["turns_per_trajectory"].append(float(row.get("agent/turns_mean") or "nan"))
                curves["batch_accuracy"].append(float(row.get("rewards/accuracy/mean") or "nan"))
    return curves


def _spans(text: str, answer: str | None = None) -> dict[str, tuple[int, int]]:
    """Character spans of what a tool-use message must get right: the call's arguments (``{...}`` after
    ``"arguments":``), a zoom call's box (the numbers inside ``[...]`` after ``"bbox_2d":``) and the answer (inside
    ``<answer>...</answer>``)."""
    spans = {}
    if '"arguments":' in text:
        start = text.index("{", text.index('"arguments":'))
        spans["call_arguments"] = (start, text.rindex("}", start, text.rindex("}")) + 1)
    if '"bbox_2d": [' in text:
        start = text.index('"bbox_2d": [') + len('"bbox_2d": [')
        spans["bbox_2d"] = (start, text.index("]", start))
    if "<answer>" in text and "</answer>" in text:
        spans["answer"] = (text.index("<answer>") + len("<answer>"), text.index("</answer>"))
        if answer and answer in text:  # where the message first states the answer (a think part may, before the tag)
            spans["answer_first"] = (text.index(answer), text.index(answer) + len(answer))
    return spans


def diagnose(checkpoint: Path, task: str, tools: Sequence[str], size: int, seed: int = EVAL_SEED) -> dict[str, Any]:
    """Which part of a tool-use trace a checkpoint gets right, teacher-forced on ``size`` held-out rows.

    Per part (``call_arguments``: the call's argument tokens; ``bbox_2d``: those of a zoom call's box, the
    coordinates and the commas between them; ``answer``: the final answer's tokens, read after the gold tool
    answer; ``answer_first``: the tokens where the final message first states the answer, e.g. in its think part:
    where the reading happens, the ``answer`` tag may then only copy it): the mean negative log-likelihood per
    token and ``exact``, the share of rows where every token of the part has probability > 0.5 under the gold
    prefix (then greedy decoding, given the prefix, writes the part exactly); ``by_difficulty``: the same per
    difficulty level of the rows. The prompt, tool prompt and token layout are those of ``AgentSFTModule``."""
    import torch

    from mmpo.algos.agent import encode_tool_traces
    from mmpo.data.synthetic import make_items
    from mmpo.tools.functions import load_tools, tool_system_prompt
    from mmpo.vlm.factory import load_model
    from mmpo.vlm.logprobs import completion_log_probs
    from mmpo.vlm.processing import append_row_images, default_system_prompt, encode_prompts

    model, processor = load_model(str(checkpoint))
    model.eval()
    tokenizer = processor.tokenizer
    schemas = [tool.schema for tool in load_tools(list(tools))]
    system = tool_system_prompt(default_system_prompt(), schemas)
    rows = make_items(task, size, seed=seed, split="test")
    parts: dict[str, list[tuple[int, list[float]]]] = {}
    for start in range(0, len(rows), 8):
        batch = rows[start:start + 8]
        prompts = encode_prompts(processor, batch, system_prompt=system)
        ids, mask, attention, images = encode_tool_traces(processor, [row["tool_trace"] for row in batch])
        prompts = append_row_images(prompts, images)
        with torch.no_grad():
            log_probs, _ = completion_log_probs(model, prompts, ids, attention)
        for i, row in enumerate(batch):
            offset = 0
            positions = mask[i].nonzero().flatten().tolist()  # the assistant tokens, in order
            found: dict[str, list[float]] = {}
            for message in row["tool_trace"]:
                if message["role"] != "assistant":
                    continue
                encoded = tokenizer(message["content"], add_special_tokens=False, return_offsets_mapping=True)
                for name, (lo, hi) in _spans(message["content"], row["answer"]).items():
                    found[name] = [float(log_probs[i, positions[offset + k]])
                                   for k, (a, b) in enumerate(encoded["offset_mapping"]) if a < hi and b > lo]
                offset += len(encoded["input_ids"]) + 1  # + the turn-end token
            for name, values in found.items():
                parts.setdefault(name, []).append((row["difficulty"], values))
    import math

    def score(values: list[list[float]]) -> dict[str, float]:
        return {"nll_per_token": -sum(sum(v) for v in values) / sum(len(v) for v in values),
                "exact": sum(all(x > math.log(0.5) for x in v) for v in values) / len(values), "rows": len(values)}

    return {name: {**score([v for _, v in found]),
                   "by_difficulty": {level: score([v for lv, v in found if lv == level])
                                     for level in sorted({lv for lv, _ in found})}}
            for name, found in parts.items()}


def run_seed(task: str, seed: int, out: Path, *, sft_steps: int, rl_steps: int, eval_size: int,
             max_new_tokens: int | None = None, algos: Sequence[str] | None = None,
             sft_start: Path | None = None, eval_split: str = "test") -> dict[str, Any]:
    """SFT, RL and the evaluations of one task and seed; returns (and stores) the seed's results.
    ``max_new_tokens``: tokens per model turn in RL and evaluation (None: the task's, as its configs).
    ``sft_start``: an SFT checkpoint to start RL from instead of an SFT run here (copied into the seed's directory
    and recorded): one shared by every seed (only the RL seed varies; its evaluations, greedy on the same items, are
    taken from a finished seed with the same start when there is one), or each seed's own (``--sft-start`` with
    ``{seed}``: the SFT seed varies too). ``eval_split``: the items evaluated, ``test`` (held out) or ``val`` (to
    choose settings such as the RL learning rate and steps without looking at the test items); recorded, and a
    seed directory evaluated on the other split is refused."""
    from mmpo.vlm.factory import build_tiny_text_lm, build_tiny_vlm, tool_task_corpus

    spec = TASKS[task]
    max_new_tokens = max_new_tokens or spec["max_new_tokens"]
    root = out / task / f"s{seed}"
    path = root / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {
        "task": task, "seed": seed, "sft_steps": sft_steps, "rl_steps": rl_steps, "eval_size": eval_size,
        "eval": {}, "training_tool_calls": {}, "rl_overrides": list(RL_OVERRIDES), "eval_split": eval_split,
        "sft_overrides": list(SFT_OVERRIDES), "model_size": dict(MODEL_SIZE[spec["kind"]])}
    if results.get("eval_split", "test") != eval_split:
        raise ValueError(f"{path} was evaluated on the {results.get('eval_split', 'test')} split, not {eval_split}: "
                         "use another --out")
    base = root / "base"
    if sft_start is not None:
        if not (root / "sft" / "config.json").exists():
            shutil.copytree(sft_start, root / "sft")
        results["sft_start"], results["sft_steps"] = str(sft_start), None
    elif not (base / "config.json").exists():
        builder = build_tiny_text_lm if spec["kind"] == "text" else build_tiny_vlm
        tokenizer: dict[str, Any] = ({"corpus": tool_task_corpus(task, spec["tools"], vlm=spec["kind"] == "vlm")}
                                     if spec.get("tool_tokenizer") else {})
        if spec.get("individual_digits"):
            tokenizer["individual_digits"] = True
        builder(base, seed=seed, **MODEL_SIZE[spec["kind"]], **tokenizer)
    checkpoints = {"sft": root / "sft"}
    if not (checkpoints["sft"] / "config.json").exists():
        _fit(spec["sft"], root / "sft_run", base, checkpoints["sft"], sft_steps, seed,
             [f"--data.init_args.seed={seed}", *spec.get("overrides", []), *SFT_OVERRIDES])
    for algo in algos or list(spec["algos"]):
        checkpoints[algo] = root / algo
        if not (checkpoints[algo] / "config.json").exists():
            seeds = [f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}"]
            seeds += [f"--model.init_args.arpo.seed={seed}"] if algo == "arpo" else []
            _fit(spec["algos"][algo], root / f"{algo}_run", checkpoints["sft"], checkpoints[algo], rl_steps, seed,
                 [f"--model.init_args.sampling.max_new_tokens={max_new_tokens}", *seeds, *spec.get("overrides", []),
                  *spec.get("rl_overrides", []), *RL_OVERRIDES])
        results["training_tool_calls"][algo] = _training_tool_calls(root / f"{algo}_run")
        results.setdefault("training", {})[algo] = _training_curves(root / f"{algo}_run")
    if sft_start is not None:  # a shared start's evaluations (greedy, the same items) are the same for every seed
        for other in sorted((out / task).glob("s*/results.json")):
            done = json.loads(other.read_text())
            if (done.get("sft_start") == str(sft_start) and done["eval_size"] == eval_size
                    and done.get("eval_split", "test") == eval_split):
                for key in ("sft/with_tools", "sft/without_tools"):
                    if key in done["eval"] and key not in results["eval"]:
                        results["eval"][key] = done["eval"][key]
    for name, checkpoint in checkpoints.items():
        for mode, tools in (("with_tools", spec["tools"]), ("without_tools", None)):
            key = f"{name}/{mode}"
            if key not in results["eval"]:
                results["eval"][key] = _evaluate(checkpoint, task, tools, eval_size, max_new_tokens,
                                                 root / "eval" / name / mode, split=eval_split)
                atomic_write_json(path, results)
    atomic_write_json(path, results)
    return results


def _contrast(seeds: list[dict[str, Any]], a: str, b: str) -> str:
    pairs = [(s["eval"][a]["correct"], s["eval"][b]["correct"]) for s in seeds if a in s["eval"] and b in s["eval"]]
    if not pairs:
        return f"| {a} - {b} | n/a | n/a | n/a | 0 |"
    result = paired_difference([p[0] for p in pairs], [p[1] for p in pairs])
    return (f"| {a} - {b} | {result['estimate']:+.3f} | {format_interval(result['bootstrap'])} | "
            f"{format_interval(result['seed_t'])} | {len(pairs)} |")


def _paired_lists(seeds: list[dict[str, Any]], a: list[list[float]] | None, b: list[list[float]] | None,
                  label: str) -> str:
    if not a or not b:
        return f"| {label} | n/a | n/a | n/a | 0 | n/a |"
    length = [min(len(x), len(y)) for x, y in zip(a, b)]
    result = paired_difference([x[:n] for x, n in zip(a, length)], [y[:n] for y, n in zip(b, length)])
    means = [sum(x[:n]) / n for x, n in zip(a, length)], [sum(y[:n]) / n for y, n in zip(b, length)]
    ratio = sum(means[0]) / sum(means[1]) if sum(means[1]) else float("nan")
    return (f"| {label} | {result['estimate']:+.3f} | {format_interval(result['bootstrap'])} | "
            f"{format_interval(result['seed_t'])} | {len(a)} | {ratio:.2f} |")


def tool_call_contrasts(seeds: list[dict[str, Any]], a: str = "arpo", b: str = "grpo") -> list[str]:
    """Markdown rows of ``a`` - ``b`` in tool use and accuracy: at evaluation paired by item (tool calls per
    item, accuracy), in training paired by step (the two runs of a seed see the same prompts at each step: same
    data seed): tool calls per trajectory, tool calls executed per step, batch accuracy. Last column: the ratio of
    the two means."""
    both = [s for s in seeds if f"{a}/with_tools" in s["eval"] and f"{b}/with_tools" in s["eval"]]

    def evaluation(algo: str, field: str) -> list[list[float]] | None:
        values = [s["eval"][f"{algo}/with_tools"].get(field) for s in both]
        return None if any(v is None for v in values) else values

    def training(algo: str, field: str) -> list[list[float]] | None:
        values = [s.get("training", {}).get(algo, {}).get(field) for s in both]
        return None if not values or any(not v for v in values) else values

    rows = ["| contrast | estimate | 95% bootstrap | 95% seed-t | seeds | ratio of means |",
            "| --- | --- | --- | --- | --- | --- |"]
    for label, source, field in (("tool calls per item (eval, paired by item)", evaluation, "tool_calls"),
                                 ("accuracy with the tool (eval, paired by item)", evaluation, "correct"),
                                 ("tool calls per trajectory (training, paired by step)", training,
                                  "tool_calls_per_trajectory"),
                                 ("tool calls executed per step (training, paired by step)", training,
                                  "executed_tool_calls"),
                                 ("batch accuracy (training, paired by step)", training, "batch_accuracy")):
        rows.append(_paired_lists(both, source(a, field), source(b, field), f"{a} - {b}: {label}"))
    return rows


def by_difficulty(entries: list[dict[str, Any]]) -> dict[int, tuple[float, int]]:
    """Right answers and items per difficulty level, summed over evaluations that record ``difficulty`` (older ones
    do not: skipped)."""
    counts: dict[int, tuple[float, int]] = {}
    for entry in entries:
        for level, correct in zip(entry.get("difficulty") or [], entry["correct"]):
            right, total = counts.get(level, (0.0, 0))
            counts[level] = (right + correct, total + 1)
    return counts


def report(out: Path) -> str:
    """Markdown tables over every finished seed of every task; written to ``OUT/report.md``."""
    lines = ["# Tool use: SFT start vs RL, with and without tools (bench/bench_agents.py)", ""]
    for task, spec in TASKS.items():
        seeds = [json.loads(p.read_text()) for p in sorted((out / task).glob("s*/results.json"))]
        if not seeds:
            continue
        first = seeds[0]
        starts = sorted({s["sft_start"] for s in seeds if s.get("sft_start")})
        start = (f"one shared SFT start ({starts[0]})" if len(starts) == 1
                 else f"per-seed SFT starts ({', '.join(starts)})" if starts else f"SFT {first['sft_steps']} steps")
        split = first.get("eval_split", "test")
        items = "held-out test items" if split == "test" else "validation items (not the test split)"
        lines += [f"## {task}", "", f"Seeds: {[s['seed'] for s in seeds]}; {start}, RL "
                  f"{first['rl_steps']} steps; {first['eval_size']} {items}, greedy.", "",
                  "| checkpoint | accuracy (mean ± sd over seeds) | tool-call rate | tool calls / answer | "
                  "turns / answer | training tool calls / trajectory | training tool calls executed / step |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        keys = sorted({key for s in seeds for key in s["eval"]})
        for key in keys:
            rows = [s["eval"][key] for s in seeds if key in s["eval"]]
            algo = key.split("/")[0]
            training = [s["training_tool_calls"].get(algo) for s in seeds if s["training_tool_calls"].get(algo) is not None]

            def stat(name: str) -> str:
                values = [row[name] for row in rows if name in row]
                return mean_std(values) if values else "-"

            executed = [sum(curve) / len(curve) for s in seeds
                        if (curve := s.get("training", {}).get(algo, {}).get("executed_tool_calls"))]
            with_tools = key.endswith("with_tools")
            lines.append(f"| {key} | {stat('accuracy')} | {stat('tool_call_rate')} | {stat('tool_calls_per_answer')} | "
                         f"{stat('turns_per_answer')} | {mean_std(training) if training and with_tools else '-'} | "
                         f"{mean_std(executed) if executed and with_tools else '-'} |")
        levels = [(key, by_difficulty([s["eval"][key] for s in seeds if key in s["eval"]])) for key in keys]
        if any(counts for _, counts in levels):
            lines += ["", "Accuracy by difficulty level (right / items, summed over seeds):", ""]
            lines += [f"- {key}: " + ", ".join(f"level {level} {right:g}/{total}" for level, (right, total)
                                                in sorted(counts.items())) for key, counts in levels if counts]
        lines += ["", "| contrast (paired by item) | estimate | 95% bootstrap | 95% seed-t | seeds |",
                  "| --- | --- | --- | --- | --- |"]
        for algo in spec["algos"]:
            lines.append(_contrast(seeds, f"{algo}/with_tools", f"{algo}/without_tools"))
            lines.append(_contrast(seeds, f"{algo}/with_tools", "sft/with_tools"))
        if "arpo" in spec["algos"]:
            lines.append(_contrast(seeds, "arpo/with_tools", "grpo/with_tools"))
            lines += ["", *tool_call_contrasts(seeds)]
        lines.append("")
    text = "\n".join(lines)
    atomic_write_text(out / "report.md", text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    run = sub.add_parser("run", help="SFT + RL + evaluations for one task and some seeds")
    run.add_argument("--task", choices=sorted(TASKS), required=True)
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    run.add_argument("--sft-steps", type=int, default=300)
    run.add_argument("--rl-steps", type=int, default=40)
    run.add_argument("--eval-size", type=int, default=100)
    run.add_argument("--max-new-tokens", type=int, default=None,
                     help="tokens per model turn, training and eval (default: the task's configs': calc 96, zoom 128)")
    run.add_argument("--algos", nargs="+", default=None, help="RL algorithms (default: all of the task's)")
    run.add_argument("--rl-lr", type=float, default=None, help="RL learning rate (default: the RL configs', 1e-4)")
    run.add_argument("--sft-start", default=None,
                     help="an SFT checkpoint every seed starts RL from, or a per-seed one with '{seed}' in the path "
                          "(runs/s{seed}/sft); default: each seed's own SFT of --sft-steps steps")
    run.add_argument("--rl-override", action="append", default=[], metavar="KEY=VALUE",
                     help="an extra 'mmpo fit' override of every RL run, e.g. model.init_args.loss.beta=0.01 (repeatable)")
    run.add_argument("--eval-split", choices=["test", "val"], default="test",
                     help="evaluate on the held-out test items (default) or on validation items, to choose RL "
                          "settings without looking at the test items")
    run.add_argument("--model-size", action="append", default=[], metavar="KEY=VALUE",
                     help="a size of the tiny model the SFT starts from (build_tiny_vlm / build_tiny_text_lm keyword, "
                          "integer), e.g. min_pixels=12544 or vision_depth=2 (repeatable)")
    run.add_argument("--sft-aux-task", action="append", default=[], metavar="TASK",
                     help="auxiliary rows of the SFT warm-up: another synthetic task mixed into the task's training "
                          "rows in equal shares, e.g. zoom_digit_read (repeatable)")
    run.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report", help="tables over the finished seeds -> OUT/report.md")
    rep.add_argument("--out", type=Path, required=True)
    diag = sub.add_parser("diagnose", help="teacher-forced: does a checkpoint get the call's arguments and the answer "
                                           "right (held-out rows)? -> JSON")
    diag.add_argument("--task", choices=sorted(TASKS), required=True)
    diag.add_argument("--checkpoint", type=Path, required=True)
    diag.add_argument("--size", type=int, default=50)
    diag.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.stage == "diagnose":
        result = diagnose(args.checkpoint, args.task, TASKS[args.task]["tools"], args.size)
        if args.out is not None:
            atomic_write_json(args.out, result)
        print(json.dumps(result, indent=2))
        return 0
    if args.stage == "run":
        if args.rl_lr is not None:
            RL_OVERRIDES.append(f"--model.init_args.optim.lr={args.rl_lr}")
        kind = TASKS[args.task]["kind"]
        for size in args.model_size:
            key, _, value = size.partition("=")
            if not value or not value.lstrip("-").isdigit():
                parser.error(f"--model-size {size!r}: expected KEY=INTEGER")
            MODEL_SIZE[kind][key] = int(value)
        for aux in args.sft_aux_task:
            if aux not in TASKS or TASKS[aux]["kind"] != kind:
                parser.error(f"--sft-aux-task {aux!r}: not a {kind} task of this bench ({sorted(TASKS)})")
        if args.sft_aux_task:
            SFT_OVERRIDES.append(f"--data.init_args.tasks=[{','.join([args.task, *args.sft_aux_task])}]")
        for override in args.rl_override:
            if "=" not in override:
                parser.error(f"--rl-override {override!r}: expected KEY=VALUE")
            RL_OVERRIDES.append(f"--{override.lstrip('-')}")
        for seed in args.seeds:
            sft_start = Path(args.sft_start.replace("{seed}", str(seed))) if args.sft_start else None
            run_seed(args.task, seed, args.out, sft_steps=args.sft_steps, rl_steps=args.rl_steps,
                     eval_size=args.eval_size, max_new_tokens=args.max_new_tokens, algos=args.algos,
                     sft_start=sft_start, eval_split=args.eval_split)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
