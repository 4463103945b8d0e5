"""``mmpo eval``: evaluate a checkpoint on named benchmarks and write JSON, markdown and a plot.

Example::

    mmpo eval --model runs/quickstart/grpo/hf --benchmarks synth/all --limit 40 --out runs/eval
    mmpo eval --model CKPT --benchmarks synth/count_shapes,file:data/geo3k.jsonl \\
        --num-samples 8 --temperature 0.7 --out runs/eval_k8
    mmpo eval --model CKPT --benchmarks mathvista_testmini,chartqa_test --data-dir ~/benchmarks --out runs/eval_mv
    mmpo eval --model runs/tiny/calc_grpo --benchmarks synth/calc --tools calculator --out runs/eval_calc
    mmpo eval --model CKPT --benchmarks mathvista_testmini,mathverse_testmini --data-dir ~/benchmarks \
        --judge http://127.0.0.1:8000 --judge-model Qwen/Qwen2.5-7B-Instruct --judge-benchmarks mathvista,mathverse \
        --out runs/eval_judged   # the official LLM answer extraction beside the rule's (docs/eval.md)
    mmpo eval --list     # every benchmark name, and the files each local benchmark expects
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from mmpo.eval.registry import DEFAULT_SYNTH_SEED, DEFAULT_SYNTH_SIZE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmpo eval",
        usage="%(prog)s --model PATH --benchmarks NAMES --out DIR [options]\n       %(prog)s --list",
        description="Evaluate a VLM or dLLM checkpoint: accuracy, avg@k and pass@k per benchmark. "
        "Writes results.json, results.md, accuracy.png and predictions/*.jsonl under --out.",
    )
    parser.add_argument("--model", required=True, help="checkpoint: a save_pretrained directory or a dLLM checkpoint")
    parser.add_argument("--list", action="store_true",
                        help="print the registered benchmarks and exit (needs no other option)")
    parser.add_argument("--benchmarks", required=True,
                        help="comma-separated names: synth/all, synth/<task>, file:<path>, or a registered name "
                             "such as mathvista_testmini (`--list` shows them and the files each expects)")
    parser.add_argument("--data-dir", default=None,
                        help="folder holding the named benchmarks' files in their publishers' layouts, e.g. "
                             "DIR/MathVista/data/testmini-*.parquet (`--list` shows each one's layout); or a YAML "
                             "file mapping benchmark names to their folders")
    parser.add_argument("--num-samples", "--k", dest="num_samples", type=int, default=1,
                        help="answers sampled per item (k of avg@k / pass@k); >1 needs --temperature (default 1)")
    decoding = parser.add_mutually_exclusive_group()
    decoding.add_argument("--greedy", action="store_true", help="greedy decoding (the default when k is 1)")
    decoding.add_argument("--temperature", type=float, default=None,
                          help="sampling temperature (default: greedy for k=1, 1.0 for k>1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="generation budget per answer (default 128: above the tiny configs' training budget "
                        "of 48-64 so an answer is not cut short by eval alone, yet quick on a CPU; use the "
                        "training value for real checkpoints, e.g. 2048 for the 7B configs)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N items of each benchmark")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--synth-size", type=int, default=DEFAULT_SYNTH_SIZE,
                        help="items per task in synth/* benchmarks (held-out test split)")
    parser.add_argument("--synth-seed", type=int, default=DEFAULT_SYNTH_SEED, help="seed of the synthetic test split")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for sampling")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", default="float32",
                        help="VLM weight dtype: float32, bfloat16, float16 (default float32, the training "
                        "modules' default dtype too; bfloat16 halves memory for real checkpoints on GPUs)")
    parser.add_argument("--min-pixels", type=int, default=None,
                        help="VLM image pixel budget, lower bound (as the training modules' min_pixels; "
                        "default: the saved processor's)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="VLM image pixel budget, upper bound (as the training modules' max_pixels; "
                        "default: the saved processor's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: OMP_NUM_THREADS or torch's default)")
    parser.add_argument("--prompt-style", choices=["think-answer", "steps"], default="think-answer",
                        help="system prompt of the answer format the model was trained on (steps = StepGRPO)")
    parser.add_argument("--tools", default=None,
                        help="evaluate with tools, comma-separated (calculator, python, image_zoom_in_tool, codebook, "
                        "path/file.py:fn): multi-turn answers; reports the tool-call rate, tool calls and turns per "
                        "answer, and each answer's conversation in predictions/*.jsonl (docs/agents.md)")
    parser.add_argument("--max-turns", type=int, default=3, help="with --tools: model turns per answer")
    parser.add_argument("--max-total-tokens", type=int, default=512,
                        help="with --tools: completion tokens per answer, model and tool tokens together")
    parser.add_argument("--tool-timeout", type=float, default=10.0, help="with --tools: deadline of one tool call, s")
    parser.add_argument("--judge", default=None,
                        help="also score MathVista / MathVerse with their official LLM answer extraction by this "
                        "judge: an OpenAI-compatible server URL (http://127.0.0.1:8000), a local model directory, "
                        "path/file.py:factory, or a YAML file of judge settings as in rewards.models (docs/eval.md)")
    parser.add_argument("--judge-model", default=None, help="with --judge URL: the model name sent to the server")
    parser.add_argument("--judge-benchmarks", default=None,
                        help="with --judge: comma-separated benchmarks of --benchmarks, or protocols (mathvista, "
                        "mathverse: every benchmark of that family), to judge-score (default: every MathVista and "
                        "MathVerse benchmark of the run)")
    parser.add_argument("--mathverse-scoring", choices=["judge", "rule"], default="judge",
                        help="with --judge: MathVerse's second stage: the judge decides whether the extraction matches "
                        "the standard answer (judge, the official protocol) or the benchmark's rule does (rule)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mmpo eval``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--list" in argv:
        from mmpo.eval.registry import describe_benchmarks

        print(describe_benchmarks())
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    greedy = args.temperature is None and args.num_samples == 1
    if args.greedy and args.num_samples > 1:
        parser.error("--greedy with --num-samples > 1 would give identical samples; drop --greedy or use k=1")
    temperature = 1.0 if args.temperature is None else args.temperature
    names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    if not names:
        parser.error("--benchmarks is empty")

    import torch

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)

    from mmpo.eval.harness import NotAModelError, ToolUse, evaluate_checkpoint
    from mmpo.tools.functions import ToolSpecError
    from mmpo.eval.registry import UnknownBenchmarkError
    from mmpo.data import system_prompt_for
    from mmpo.eval.reports import results_table

    if args.judge is None and (args.judge_model or args.judge_benchmarks):
        parser.error("--judge-model and --judge-benchmarks need --judge")
    tool_use = None
    judge_eval = None
    try:
        if args.tools is not None:
            tool_use = ToolUse(tuple(name.strip() for name in args.tools.split(",") if name.strip()),
                               max_turns=args.max_turns, max_total_tokens=args.max_total_tokens,
                               tool_timeout_s=args.tool_timeout)
        if args.judge is not None:
            from mmpo.eval.judge_extraction import JudgeEval, judge_spec

            selected = tuple(name.strip() for name in (args.judge_benchmarks or "").split(",") if name.strip())
            judge_eval = JudgeEval(judge_spec(args.judge, args.judge_model), selected, args.mathverse_scoring)
        results = evaluate_checkpoint(
            args.model, names, num_samples=args.num_samples, greedy=greedy, temperature=temperature,
            top_p=args.top_p, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
            synth_size=args.synth_size, synth_seed=args.synth_seed, seed=args.seed, out_dir=args.out,
            progress=not args.no_progress, device=args.device, dtype=args.dtype,
            system_prompt=system_prompt_for(args.prompt_style), data_dir=args.data_dir,
            min_pixels=args.min_pixels, max_pixels=args.max_pixels, tool_use=tool_use, judge_eval=judge_eval,
        )
    except (UnknownBenchmarkError, NotAModelError, FileNotFoundError, ValueError, ToolSpecError) as error:
        print(f"mmpo eval: error: {error}", file=sys.stderr)
        return 2
    print(results_table(results))
    print(f"\nwrote {os.path.join(args.out, 'results.json')}, results.md, accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
