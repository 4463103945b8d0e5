"""``mmpo build-tiny --out DIR``: the tiny Qwen2.5-VL the tiny VLM configs start from; with
``--kind text``, the tiny Qwen3 text LM of the tiny text configs (configs/llm, docs/llm.md); with
``--kind reward_model``, a tiny Qwen3 sequence classifier (the reward model of
configs/vlm/grpo_tiny_reward_model.yaml, docs/rewards.md).

The same builders the quickstart uses (``mmpo.vlm.factory.build_tiny_vlm`` / ``build_tiny_text_lm``);
the size flags are read from those functions' integer keyword arguments, so they never drift apart
(a flag only the VLM has, e.g. ``--vision-depth``, is refused with ``--kind text``). The model is
built in a temporary folder beside ``--out`` and renamed into place when complete, so an
interrupted build leaves no half-written model, and an existing ``--out`` is kept unless
``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from mmpo.vlm.factory import build_tiny_reward_model, build_tiny_text_lm, build_tiny_vlm

DEFAULT_OUT = "runs/tiny/base"  # model_path of configs/vlm/sft_tiny.yaml
DEFAULT_TEXT_OUT = "runs/tiny/text_base"  # model_path of configs/llm/sft_tiny.yaml
DEFAULT_REWARD_MODEL_OUT = "runs/tiny/reward_model"  # the reward model of configs/vlm/grpo_tiny_reward_model.yaml
BUILDERS = {"vlm": build_tiny_vlm, "text": build_tiny_text_lm, "reward_model": build_tiny_reward_model}
DEFAULT_OUTS = {"vlm": DEFAULT_OUT, "text": DEFAULT_TEXT_OUT, "reward_model": DEFAULT_REWARD_MODEL_OUT}


def size_parameters(kind: str = "vlm") -> dict[str, int]:
    """The builder's integer keyword arguments (the sizes) and their defaults; ``seed`` excluded."""
    return {
        name: param.default
        for name, param in inspect.signature(BUILDERS[kind]).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY and type(param.default) is int and name != "seed"
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmpo build-tiny",
        description="Build a tiny randomly initialised Qwen2.5-VL (real Qwen2_5_VLForConditionalGeneration, "
        "tokenizer trained locally on the synthetic corpus, real Qwen2_5_VLProcessor) for the tiny VLM "
        f"configs: `mmpo build-tiny` writes {DEFAULT_OUT}, the model_path of configs/vlm/sft_tiny.yaml.",
    )
    parser.add_argument("--kind", choices=sorted(BUILDERS), default="vlm",
                        help="vlm: a tiny Qwen2.5-VL (default); text: a tiny Qwen3 text LM (configs/llm); "
                        "reward_model: a tiny Qwen3 sequence classifier (docs/rewards.md)")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: {DEFAULT_OUT}; with --kind text {DEFAULT_TEXT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default: 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    text_sizes = size_parameters("text")
    for name, default in size_parameters("vlm").items():
        note = "" if name in text_sizes else " (vlm only)"
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default: {default}{note}")
    return parser


def build_tiny_to(out: Path, *, seed: int, overwrite: bool, sizes: dict[str, int], kind: str = "vlm") -> Path:
    """Build into a temporary sibling of ``out``, then rename it into place (replaces ``out`` only if ``overwrite``)."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        BUILDERS[kind](staging, seed=seed, **sizes)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(staging, out)
            shutil.rmtree(old)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mmpo build-tiny``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    accepted = size_parameters(args.kind)
    given = {name: getattr(args, name) for name in size_parameters("vlm") if getattr(args, name) is not None}
    refused = sorted(set(given) - set(accepted))
    if refused:
        parser.error(f"--kind {args.kind} has no " + ", ".join("--" + n.replace("_", "-") for n in refused))
    sizes = {name: given.get(name, default) for name, default in accepted.items()}
    out_dir = Path(args.out or DEFAULT_OUTS[args.kind])
    try:
        out = build_tiny_to(out_dir, seed=args.seed, overwrite=args.overwrite, sizes=sizes, kind=args.kind)
    except (FileExistsError, ValueError) as error:
        print(f"mmpo build-tiny: error: {error}", file=sys.stderr)
        return 2
    name = {"vlm": "Qwen2.5-VL", "text": "Qwen3 text LM", "reward_model": "Qwen3 reward model"}[args.kind]
    print(f"tiny {name} written to {out} (load it with mmpo.vlm.factory.load_vlm, or as model_path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
