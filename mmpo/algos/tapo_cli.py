"""``mmpo tapo-library``: build TAPO's thought-template library from seed problems with a saved policy.

Each node of the action tree (a sequence of reasoning actions) is scored on a seed problem by the mean reward of
``--samples`` completions sampled with its template before the problem (mmpo.algos.tapo.build_library). The
library is written atomically; an existing file is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmpo tapo-library", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="saved policy (HF model directory)")
    parser.add_argument("--tasks", required=True, help="comma-separated synthetic tasks giving the seed problems")
    parser.add_argument("--size", type=int, default=10, help="seed problems per task (default 10)")
    parser.add_argument("--out", required=True, help="library JSON to write")
    parser.add_argument("--samples", type=int, default=4, help="completions per scored node (default 4)")
    parser.add_argument("--max-depth", type=int, default=3, help="most actions in a template (default 3)")
    parser.add_argument("--beam", type=int, default=2, help="nodes expanded per depth (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    return parser


def policy_scorer(model: Any, processor: Any, *, samples: int, max_new_tokens: int, temperature: float, seed: int):
    """score(row, actions) = mean accuracy reward of ``samples`` completions with the template (seeded per call)."""
    from mmpo.algos.tapo import guided_problem
    from mmpo.rewards import compute_rewards
    from mmpo.vlm.rollout import HFGenerateEngine

    engine = HFGenerateEngine(model, processor)

    def score(row: Mapping[str, Any], actions: tuple[str, ...]) -> float:
        guided = {**row, "problem": guided_problem(row["problem"], actions)}
        with torch_fork(seed):
            texts = engine.generate([guided], num_samples=samples, max_new_tokens=max_new_tokens,
                                    temperature=temperature).texts
        total, _, _ = compute_rewards({"accuracy": 1.0}, list(texts), [row] * samples)
        return float(total.mean())

    return score


def torch_fork(seed: int):
    import contextlib

    import torch

    @contextlib.contextmanager
    def forked():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield

    return forked()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"mmpo tapo-library: error: {out} exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    from mmpo.files import atomic_write_json
    from mmpo.vlm.factory import load_vlm

    if min(args.samples, args.max_depth, args.beam, args.size) < 1:
        print("mmpo tapo-library: error: --samples, --max-depth, --beam and --size must be >= 1", file=sys.stderr)
        return 2
    try:
        rows = seed_problems(args.tasks.split(","), args.size, seed=args.seed)
        model, processor = load_vlm(args.model)
    except (KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"mmpo tapo-library: error: {message}", file=sys.stderr)
        return 2
    library = library_from_policy(model, processor, rows, samples=args.samples, max_depth=args.max_depth,
                                  beam=args.beam, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed)
    atomic_write_json(out, library)
    print(f"{len(library['templates'])} template(s) from {len(rows)} seed problem(s) written to {out}")
    return 0


def seed_problems(tasks: Sequence[str], size: int, *, seed: int) -> list[dict[str, Any]]:
    """``size`` training-split items of each task (never the test split that held-out scores use)."""
    from mmpo.data import synthetic

    return [row for task in tasks for row in synthetic.make_items(task, size, seed=seed, split="train")]


def library_from_policy(model: Any, processor: Any, rows: Sequence[Mapping[str, Any]], *, samples: int = 4,
                        max_depth: int = 3, beam: int = 2, max_new_tokens: int = 256, temperature: float = 1.0,
                        seed: int = 0) -> dict:
    """The library of ``rows`` scored by the policy (what ``mmpo tapo-library`` writes; benchmarks call it too)."""
    from mmpo.algos.tapo import build_library

    score = policy_scorer(model, processor, samples=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed)
    return build_library(rows, score, max_depth=max_depth, beam=beam)
