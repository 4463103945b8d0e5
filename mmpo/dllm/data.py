"""LightningDataModules for the dLLM text tasks (rows are plain dicts).

The training order is resumable (``mmpo.data.resumable``): a run restarted from a
checkpoint continues at the next unseen batch with the same shuffling.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from mmpo.dllm.task import ArithmeticTaskConfig, make_train_and_test
from mmpo.data.resumable import ResumableTrainData, collate_rows as _rows


class _TextRows(ResumableTrainData, pl.LightningDataModule):
    """Shared plumbing: rows are built by ``setup``; the training loader is resumable."""

    train_rows: list[dict[str, str]]
    drop_last = True
    num_workers = 0

    def _training_rows(self) -> list[dict[str, str]]:
        self.setup()
        return self.train_rows

    def _num_train_rows(self) -> int | None:
        return len(self.train_rows) if self.train_rows else None


class ArithmeticDataModule(_TextRows):
    """Train / held-out splits of :mod:`mmpo.dllm.task` problems; batches are lists of row dicts.

    Args:
        task: problem settings (number of operations, operand range).
        train_size: number of training problems.
        test_size: number of held-out problems (disjoint from train by problem string).
        val_size: how many held-out problems validation decodes (<= test_size).
        batch_size: rows per training batch (SFT: sequences; RL: prompts, each rolled out G times).
        val_batch_size: rows per validation batch.
        seed: split seed and shuffling seed (epoch e shuffles with seed + e).
    """

    def __init__(
        self,
        task: ArithmeticTaskConfig | None = None,
        train_size: int = 2500,
        test_size: int = 256,
        val_size: int = 128,
        batch_size: int = 32,
        val_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.task = task or ArithmeticTaskConfig()
        if val_size > test_size:
            raise ValueError(f"val_size ({val_size}) must be <= test_size ({test_size})")
        self.train_size, self.test_size, self.val_size = train_size, test_size, val_size
        self.batch_size, self.val_batch_size, self.seed = batch_size, val_batch_size, seed
        self.train_rows: list[dict[str, str]] = []
        self.test_rows: list[dict[str, str]] = []
        self._train_sampler = None
        self._pending_position = None

    def setup(self, stage: str | None = None) -> None:
        if not self.train_rows:
            self.train_rows, self.test_rows = make_train_and_test(self.task, self.train_size, self.test_size, self.seed)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_rows[: self.val_size], batch_size=self.val_batch_size, collate_fn=_rows)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_rows, batch_size=self.val_batch_size, collate_fn=_rows)


class TraceFileDataModule(_TextRows):
    """Rows from local JSONL files (one object per line with ``problem``, ``trace``, ``answer``).

    For real-scale runs, e.g. MetaMathQA GSM/MATH rows converted to this layout (IGPO's
    trace = the worked solution, answer = the text after "The answer is:"). A row missing a
    field raises ValueError naming the file and line.

    Args:
        train_path: JSONL file of training rows.
        test_path: JSONL file of held-out rows.
        batch_size: prompts per training batch.
        val_batch_size: rows per validation batch.
        val_size: how many held-out rows validation decodes (None: all).
        seed: shuffling seed (epoch e shuffles with seed + e).
    """

    def __init__(
        self, train_path: str, test_path: str, batch_size: int = 8, val_batch_size: int = 32,
        val_size: int | None = None, seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_path, self.test_path = train_path, test_path
        self.batch_size, self.val_batch_size, self.val_size, self.seed = batch_size, val_batch_size, val_size, seed
        self.train_rows: list[dict[str, str]] = []
        self.test_rows: list[dict[str, str]] = []
        self._train_sampler = None
        self._pending_position = None

    @staticmethod
    def read(path: str) -> list[dict[str, str]]:
        import json

        rows = []
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = [key for key in ("problem", "trace", "answer") if key not in row]
                if missing:
                    raise ValueError(f"{path}:{number}: row is missing {missing}")
                row.setdefault("id", f"{path}:{number}")
                rows.append({key: str(value) for key, value in row.items()})
        if not rows:
            raise ValueError(f"{path} holds no rows")
        return rows

    def setup(self, stage: str | None = None) -> None:
        if not self.train_rows:
            self.train_rows, self.test_rows = self.read(self.train_path), self.read(self.test_path)

    def val_dataloader(self) -> DataLoader:
        rows = self.test_rows if self.val_size is None else self.test_rows[: self.val_size]
        return DataLoader(rows, batch_size=self.val_batch_size, collate_fn=_rows)
