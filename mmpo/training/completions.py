"""Rollout samples a user can read: prompts, sampled completions, rewards per function and advantages.

The RL modules (``GRPOModule`` and its variants, ``DiffuGRPO``) keep their last step's rollout as
``module.completion_samples`` (:class:`CompletionSamples`). The :class:`LogCompletions` callback (TRL's
``log_completions`` / ``num_completions_to_print``) writes it every ``every_n_steps`` optimizer steps to:

- ``<log dir>/completions.csv``: one CSV appended to (rewritten atomically, mmpo.files), columns ``step``,
  ``prompt``, ``completion``, ``reward/<function>`` ..., ``reward``, ``advantage``;
- TensorBoard (``TensorBoardLogger``): a Markdown table as text under ``completions``;
- W&B (``WandbLogger``): ``log_table("completions", ...)``;
- the console when ``console=True`` (a ``rich`` table if rich is installed, else plain lines).

Add it to a config::

    trainer:
      callbacks:
        - class_path: mmpo.training.completions.LogCompletions
          init_args: {every_n_steps: 10, max_rows: 16}
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from mmpo.files import atomic_write_text

CSV_NAME = "completions.csv"
TABLE_KEY = "completions"


def sequence_advantages(advantages: Tensor, mask: Tensor | None = None) -> list[float]:
    """One advantage per completion: ``(N,)`` as is; ``(N, T)`` token advantages averaged over ``mask``'s tokens."""
    advantages = advantages.detach().float().cpu()
    if advantages.ndim == 1:
        return advantages.tolist()
    if mask is None:
        return advantages.mean(-1).tolist()
    mask = mask.detach().float().cpu()
    return ((advantages * mask).sum(-1) / mask.sum(-1).clamp_min(1)).tolist()


def _floats(values: Tensor | Sequence[float | None]) -> list[float]:
    if isinstance(values, Tensor):
        return values.detach().float().cpu().tolist()
    return [math.nan if v is None else float(v) for v in values]


@dataclass(frozen=True)
class CompletionSamples:
    """One step's rollout: N prompts (repeated per sample), completions, rewards and advantages.

    ``rewards`` holds the total reward under ``"reward"`` and each reward function's under its name.
    """

    step: int
    prompts: list[str]
    completions: list[str]
    rewards: dict[str, list[float]]
    advantages: list[float]

    @classmethod
    def build(cls, step: int, prompts: Sequence[str], completions: Sequence[str], total: Tensor,
              per_function: Mapping[str, Tensor | Sequence[float | None]], advantages: Tensor,
              mask: Tensor | None = None) -> "CompletionSamples":
        rewards = {name: _floats(values) for name, values in per_function.items()}
        rewards["reward"] = _floats(total)
        samples = cls(int(step), list(prompts), list(completions), rewards, sequence_advantages(advantages, mask))
        lengths = {len(samples.prompts), len(samples.completions), len(samples.advantages),
                   *(len(v) for v in rewards.values())}
        if len(lengths) != 1:
            raise ValueError(f"completion samples of unequal lengths: {sorted(lengths)}")
        return samples

    @property
    def columns(self) -> list[str]:
        functions = [f"reward/{name}" for name in self.rewards if name != "reward"]
        return ["step", "prompt", "completion", *functions, "reward", "advantage"]

    def table(self, max_rows: int | None = None) -> list[list[Any]]:
        """Rows in :attr:`columns` order (the first ``max_rows`` completions)."""
        count = len(self.completions) if max_rows is None else min(max_rows, len(self.completions))
        names = [name for name in self.rewards if name != "reward"]
        return [[self.step, self.prompts[i], self.completions[i], *(self.rewards[n][i] for n in names),
                 self.rewards["reward"][i], self.advantages[i]] for i in range(count)]


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (``|`` and newlines in cells escaped) for TensorBoard's text plugin."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def append_csv(path: Path, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    """Append ``rows`` to the CSV at ``path`` (header written once), atomically: the file is rewritten whole.

    A later step whose reward functions differ widens the header (earlier rows get empty cells)."""
    old_rows: list[dict[str, str]] = []
    header = list(columns)
    if path.is_file():
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            old_rows = list(reader)
            header = list(reader.fieldnames or []) + [c for c in columns if c not in (reader.fieldnames or [])]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, restval="")
    writer.writeheader()
    writer.writerows(old_rows)
    writer.writerows(dict(zip(columns, row)) for row in rows)
    return atomic_write_text(path, buffer.getvalue())


def print_table(samples: CompletionSamples, rows: Sequence[Sequence[Any]]) -> None:
    """The table on the console: a ``rich`` table when rich is installed, else one plain line per row."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"completions at step {samples.step}:")
        for row in rows:
            print("  " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row[1:]))
        return
    table = Table(title=f"completions at step {samples.step}", show_lines=True)
    for column in samples.columns[1:]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row[1:]))
    Console().print(table)


class LogCompletions(Callback):
    """Logs the module's ``completion_samples`` every ``every_n_steps`` optimizer steps (CSV, TensorBoard, W&B,
    optionally the console).

    Args:
        every_n_steps: log the batch during which the step count reaches a multiple of this (the first
            batch too); a batch can make several optimizer steps (GRPO minibatches).
        max_rows: at most this many completions per logged step (None: all of the step's).
        console: also print the table.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int | None = 16, console: bool = False) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.console = console
        self._last_step: int | None = None

    def csv_path(self, trainer: "pl.Trainer") -> Path:
        """``<trainer.log_dir>/completions.csv`` (the first logger's version folder; the root dir without one)."""
        return Path(trainer.log_dir or trainer.default_root_dir) / CSV_NAME

    def due(self, step: int) -> bool:
        if self._last_step is None:
            return True
        return step // self.every_n_steps > self._last_step // self.every_n_steps

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        samples: CompletionSamples | None = getattr(pl_module, "completion_samples", None)
        if samples is None or samples.step == self._last_step or not self.due(samples.step):
            return
        self._last_step = samples.step
        if trainer.global_rank != 0:
            return
        self.log_samples(trainer, samples)

    def log_samples(self, trainer: "pl.Trainer", samples: CompletionSamples) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        columns, rows = samples.columns, samples.table(self.max_rows)
        append_csv(self.csv_path(trainer), columns, rows)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(TABLE_KEY, markdown_table(columns, rows), global_step=samples.step)
            elif isinstance(logger, WandbLogger):
                logger.log_table(key=TABLE_KEY, columns=columns, data=rows, step=samples.step)
        if self.console:
            print_table(samples, rows)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = state_dict.get("last_step")


__all__ = ["CompletionSamples", "LogCompletions", "append_csv", "markdown_table", "sequence_advantages"]
