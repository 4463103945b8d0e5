"""``mmpo build-tiny --out DIR``: the tiny Qwen2.5-VL the tiny VLM configs start from.

The same builder the quickstart uses (``mmpo.vlm.factory.build_tiny_vlm``); its size flags are
read from that function's integer keyword arguments, so the two never drift apart. The model is
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

from mmpo.vlm.factory import build_tiny_vlm

DEFAULT_OUT = "runs/tiny/base"  # model_path of configs/vlm/sft_tiny.yaml


def size_parameters() -> dict[str, int]:
    """``build_tiny_vlm``'s integer keyword arguments (the sizes) and their defaults; ``seed`` excluded."""
    return {
        name: param.default
        for name, param in inspect.signature(build_tiny_vlm).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY and type(param.default) is int and name != "seed"
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmpo build-tiny",
        description="Build a tiny randomly initialised Qwen2.5-VL (real Qwen2_5_VLForConditionalGeneration, "
        "tokenizer trained locally on the synthetic corpus, real Qwen2_5_VLProcessor) for the tiny VLM "
        f"configs: `mmpo build-tiny` writes {DEFAULT_OUT}, the model_path of configs/vlm/sft_tiny.yaml.",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default: 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    for name, default in size_parameters().items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"default: {default}")
    return parser


def build_tiny_to(out: Path, *, seed: int, overwrite: bool, sizes: dict[str, int]) -> Path:
    """Build into a temporary sibling of ``out``, then rename it into place (replaces ``out`` only if ``overwrite``)."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        build_tiny_vlm(staging, seed=seed, **sizes)
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
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    sizes = {name: getattr(args, name) for name in size_parameters()}
    try:
        out = build_tiny_to(Path(args.out), seed=args.seed, overwrite=args.overwrite, sizes=sizes)
    except (FileExistsError, ValueError) as error:
        print(f"mmpo build-tiny: error: {error}", file=sys.stderr)
        return 2
    print(f"tiny Qwen2.5-VL written to {out} (load it with mmpo.vlm.factory.load_vlm, or as model_path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
