"""``mmpo practice -c CONFIG [--resume | --overwrite] [--key value ...]``: a Training-Free GRPO run.

The config holds :class:`mmpo.practice.loop.PracticeConfig`'s keys; any key can be overridden on the command
line (``--grpo_n 1``). An ``output_dir`` that already holds a run is refused unless ``--resume`` (continue it;
the config must be the same) or ``--overwrite`` (start over). Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import sys
from typing import Sequence


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    from mmpo.practice.loop import PracticeConfig

    parser = ArgumentParser(prog="mmpo practice", description="Training-Free GRPO: learn an experience library "
                            "with frozen weights (docs/prompt_space.md)")
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="YAML config")
    parser.add_class_arguments(PracticeConfig)
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir")
    parser.add_argument("--overwrite", action="store_true", help="discard the run in output_dir and start over")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from mmpo.practice.loop import PracticeConfig, PracticeRunError, TrainingFreeGRPO

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.resume and args.overwrite:
        print("mmpo practice: error: --resume and --overwrite exclude each other", file=sys.stderr)
        return 2
    options = {f: args[f] for f in PracticeConfig.__dataclass_fields__}
    try:
        runner = TrainingFreeGRPO(PracticeConfig(**options))
        state = runner.run(resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    except (PracticeRunError, ValueError, KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"mmpo practice: error: {message}", file=sys.stderr)
        return 2
    print(f"library of {len(state['experiences'])} experience(s) after {state['next_step']} step(s): "
          f"{runner.out / 'experiences.json'}")
    return 0
