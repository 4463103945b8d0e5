"""The ``mmpo`` command.

``mmpo fit|validate|test -c CONFIG`` goes through Lightning's ``LightningCLI``: a
config names the LightningModule and LightningDataModule by ``class_path``, so
one entry point serves every algorithm (VLM, masked-diffusion LM, robot policy).
The other sub-commands are plain programs, imported lazily so that, e.g.,
``mmpo demos`` does not import transformers. A command whose optional extra is not installed
(``mmpo demos`` and robot configs without ``mmpo[robotics]``) ends in one line naming the extra, exit code 2.

Exit codes of ``mmpo fit``: 0 finished; 2 a configuration error; 128 + N stopped by signal N at a step
boundary with ``last.ckpt`` saved (SIGTERM: 143, SIGUSR1: 138; mmpo.training.preemption);
``DISK_FULL_EXIT_CODE`` (28, ENOSPC's errno) a save found the disk full (one line naming the file);
1 any other error.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from mmpo._extras import MissingExtraError

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")

#: exit status when a save ran out of disk space (ENOSPC's errno number)
DISK_FULL_EXIT_CODE = 28

# sub-command -> ("module:function", one-line help). Each function takes argv.
PROGRAM_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("mmpo.quickstart:main", "build a tiny VLM, SFT warm-up, GRPO, evaluate and plot (CPU)"),
    "build-tiny": ("mmpo.vlm.tiny_cli:main", "build the tiny Qwen2.5-VL (or, --kind text, Qwen3 text LM) the tiny configs start from (CPU)"),
    "eval": ("mmpo.eval.cli:main", "evaluate a checkpoint on registered benchmarks"),
    "estimate": ("mmpo.vlm.estimate_cli:main", "per-device memory budget of a VLM config (no weights loaded)"),
    "demos": ("mmpo.robotics.cli:demos_main", "generate scripted demonstrations in robomimic's HDF5 layout"),
    "rollout": ("mmpo.robotics.cli:rollout_main", "roll out a robot policy checkpoint, optionally recording a video"),
    "list": ("mmpo.listing:main", "the registered algorithms, estimators, losses, rewards, benchmarks, robot tasks"),
    "practice": ("mmpo.practice.cli:main", "Training-Free GRPO: learn an experience library with frozen weights"),
    "tapo-library": ("mmpo.algos.tapo_cli:main", "build TAPO's thought-template library by search on seed problems"),
    "report": ("mmpo.report:main", "plots and a Markdown summary of a run's logged metrics (RUN_DIR)"),
}


def _load(target: str) -> Callable[[Sequence[str]], int | None]:
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def lightning_main(argv: Sequence[str]) -> None:
    """Run LightningCLI with model/data classes chosen by the config's ``class_path``.

    ``MMPOCli`` adds: ``--ckpt_path`` keeps the config's and command line's arguments (differences
    from the checkpoint printed, resume-breaking ones refused; mmpo.training.resume_args), and
    config mistakes end in one ``mmpo <cmd>: error: key: ...`` line with exit code 2
    (mmpo.training.cli_errors).
    """
    from lightning.pytorch import LightningDataModule, LightningModule

    from mmpo.training.cli_errors import ConfigErrorsMixin
    from mmpo.training.cli_support import MMPOLightningCLI, nested_nulls_as_mappings
    from mmpo.training.quiet import hf_progress_bars_off, quiet_lightning_notices
    from mmpo.training.resume_args import ResumeArgsMixin

    class MMPOCli(ResumeArgsMixin, ConfigErrorsMixin, MMPOLightningCLI):
        pass

    quiet_lightning_notices()  # the args-vs-sys.argv warning, Lightning's tips, device and seed lines, _pytree warning
    with hf_progress_bars_off():  # the step bar is the one progress line (no "Loading weights" bars)
        MMPOCli(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=nested_nulls_as_mappings(argv),
            save_config_kwargs={"overwrite": True},
        )


def package_version() -> str:
    """The installed distribution's version (``mmpo.__version__`` when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mmpo")
    except PackageNotFoundError:
        from mmpo import __version__

        return __version__


def _usage() -> str:
    lines = ["usage: mmpo <command> [options]", "       mmpo --version", "", "commands:"]
    for name in LIGHTNING_SUBCOMMANDS:
        lines.append(f"  {name:<11} Lightning {name} from a YAML config (-c configs/...)")
    for name, (_, help_text) in PROGRAM_SUBCOMMANDS.items():
        lines.append(f"  {name:<11} {help_text}")
    lines.append("")
    lines.append("Run `mmpo <command> --help` for a command's options.")
    return "\n".join(lines)


def _run_lightning(command: str, rest: Sequence[str]) -> int:
    """``lightning_main`` with a stop signal and a full disk turned into their exit codes."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from mmpo.training.checkpoint import disk_full_error
    from mmpo.training.preemption import preempted_exit_code, received_stop_signal

    try:
        lightning_main([command, *rest])
    except SIGTERMException:  # a SystemExit without a code: it used to exit 0 as if the run had finished
        return preempted_exit_code(received_stop_signal())
    except Exception as error:  # noqa: BLE001 - only a full disk is handled here; anything else re-raises
        full = disk_full_error(error, _written_path(error))
        if full is None:
            raise
        print(f"mmpo {command}: error: {full}", file=sys.stderr)
        return DISK_FULL_EXIT_CODE
    return 0


def _written_path(error: BaseException) -> str:
    """The file an out-of-space error was writing, as far as the exception chain tells."""
    from mmpo.training.checkpoint import DiskFullError

    current: BaseException | None = error
    fallback = "a file (the writer did not say which)"
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DiskFullError):
            return str(current.filename)
        if isinstance(current, OSError) and current.filename and fallback.startswith("a file"):
            fallback = str(current.filename)
        current = current.__cause__ or current.__context__
    return fallback


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"mmpo {package_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command in LIGHTNING_SUBCOMMANDS:
            return _run_lightning(command, rest)
        if command in PROGRAM_SUBCOMMANDS:
            result = _load(PROGRAM_SUBCOMMANDS[command][0])(rest)
            return int(result or 0)
    except MissingExtraError as exc:  # e.g. `mmpo demos` without the robotics extra: one line, exit 2
        print(f"mmpo {command}: error: {exc}", file=sys.stderr)
        return 2
    print(f"mmpo: unknown command {command!r}\n", file=sys.stderr)
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
