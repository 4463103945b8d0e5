"""``PromptDataModule``: prompts (Rows) for SFT / RL from synthetic tasks and/or local files.

Batches are ``list[Row]`` (collation is the identity on a list). Training order is a
per-epoch permutation seeded by ``seed + epoch`` (torch's ``DistributedSampler``,
which also shards across DDP ranks), and the data position is resumable:
``state_dict()`` records (epoch, batches consumed) and ``load_state_dict`` makes the
next train dataloader continue at the next unseen batch. Lightning stores the
datamodule's ``state_dict`` in every checkpoint and restores it on ``ckpt_path=...``.

Why "consumed" needs care: Lightning's fit loop pre-fetches one batch, so a
sampler's own count is one ahead when a checkpoint is written. Under a Trainer the
consumed count is read from the fit loop's batch progress (``processed`` batches of
the current epoch); outside a Trainer it is the number of batches yielded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mmpo.data.schema import Row
from mmpo.data.synthetic import DEFAULT_IMAGE_SIZE, VISUAL_TASKS, make_items

logger = logging.getLogger(__name__)


class RowDataset(Dataset):
    """A list of Rows as a map-style dataset."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]


def collate_rows(rows: list[Row]) -> list[Row]:
    """Identity collation: a batch is the list of its Rows."""
    return list(rows)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffle by ``seed + epoch``, rank sharding) that can start an
    epoch part-way through and counts the indices it has yielded.

    ``resume(epoch, start)`` skips the first ``start`` indices of that epoch's order once;
    ``set_epoch`` to a different epoch drops the pending offset.
    """

    def __init__(self, dataset: Dataset, *, seed: int, shuffle: bool = True, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = 0
        self.yielded = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
            self.yielded = 0
        super().set_epoch(epoch)

    def resume(self, epoch: int, start: int) -> None:
        """Continue epoch ``epoch`` after its first ``start`` indices (for this rank)."""
        self.epoch = epoch
        self.start = start
        self.yielded = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.start :]
        self.yielded = self.start
        self.start = 0  # the offset applies to one pass only
        for index in indices:
            self.yielded += 1
            yield index


class ResumableDataLoader(DataLoader):
    """A DataLoader whose ``state_dict`` is the owning datamodule's data position.

    Lightning saves the state of loaders that have ``state_dict`` / ``load_state_dict``
    in its fit loop and restores it on resume; without them it warns that the loader
    is not resumable. The position itself lives in ``PromptDataModule`` (one source of truth).
    """

    datamodule: PromptDataModule | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict() if self.datamodule is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.datamodule is not None and state_dict:
            self.datamodule.load_state_dict(state_dict)


class PromptDataModule(pl.LightningDataModule):
    """Rows for the VLM stages: synthetic tasks and/or a local dataset.

    Args:
        tasks: synthetic task names (default: ``VISUAL_TASKS``, the six visual tasks; ``[]`` for none).
        train_size: total synthetic training items, split evenly over ``tasks``.
        val_size: total synthetic validation items (the tasks' "val" split).
        seed: seed of the synthetic items and of the per-epoch shuffling.
        difficulty: 1..3, or None to mix levels evenly.
        batch_size: prompts per step (per rank under DDP).
        data_path: optional local dataset (see ``mmpo.data.loaders.load_rows``) added to training.
        skip_bad_rows: skip and count bad rows of ``data_path`` instead of raising.
        num_workers: DataLoader workers (0 is right for in-memory Rows).
        image_size: side of the synthetic images in pixels.
        val_data_path: optional local validation dataset.
        test_size: total synthetic items from the tasks' "test" split (0: no test loader).
        drop_last: drop a final partial training batch (keeps the prompts per step constant).
        image_root: folder for relative image paths of ``data_path`` / ``val_data_path``.
    """

    def __init__(
        self,
        tasks: list[str] | None = None,
        train_size: int = 256,
        val_size: int = 64,
        seed: int = 0,
        difficulty: int | None = None,
        batch_size: int = 8,
        data_path: str | None = None,
        skip_bad_rows: bool = False,
        num_workers: int = 0,
        image_size: int = DEFAULT_IMAGE_SIZE,
        val_data_path: str | None = None,
        test_size: int = 0,
        drop_last: bool = True,
        image_root: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored in checkpoints next to the data position
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tasks = list(VISUAL_TASKS) if tasks is None else list(tasks)
        if not self.tasks and data_path is None:
            raise ValueError("no data: give synthetic tasks and/or data_path")
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.seed, self.difficulty, self.batch_size = seed, difficulty, batch_size
        self.data_path, self.val_data_path, self.image_root = data_path, val_data_path, image_root
        self.skip_bad_rows, self.num_workers = skip_bad_rows, num_workers
        self.image_size, self.drop_last = image_size, drop_last
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []
        self.test_rows: list[Row] = []
        self.load_stats: dict[str, dict[str, Any]] = {}
        self._built = False
        self._train_sampler: ResumableSampler | None = None
        self._pending_position: tuple[int, int] | None = None

    # ----------------------------------------------------------------- rows
    def _synthetic(self, total: int, split: str) -> list[Row]:
        if not self.tasks or total <= 0:
            return []
        per_task, extra = divmod(total, len(self.tasks))
        rows: list[Row] = []
        for k, task in enumerate(self.tasks):
            rows += make_items(task, per_task + (k < extra), seed=self.seed, difficulty=self.difficulty,
                               split=split, image_size=self.image_size)
        return rows

    def _from_file(self, path: str, key: str) -> list[Row]:
        from mmpo.data.loaders import load_rows  # datasets / pyarrow only when files are used

        rows, stats = load_rows(path, skip_bad_rows=self.skip_bad_rows, image_root=self.image_root)
        self.load_stats[key] = stats
        if stats["skipped"]:
            logger.warning("%s: skipped %d bad rows of %d", path, stats["skipped"], stats["total"])
        return rows

    def build(self) -> None:
        """Generate / load all rows once (idempotent)."""
        if self._built:
            return
        self.train_rows = self._synthetic(self.train_size, "train")
        if self.data_path is not None:
            self.train_rows += self._from_file(self.data_path, "train")
        self.val_rows = self._synthetic(self.val_size, "val")
        if self.val_data_path is not None:
            self.val_rows += self._from_file(self.val_data_path, "val")
        self.test_rows = self._synthetic(self.test_size, "test")
        if not self.train_rows:
            raise ValueError("the training set is empty (train_size=0 and no rows loaded from data_path)")
        self._built = True

    def setup(self, stage: str | None = None) -> None:
        self.build()

    # ---------------------------------------------------------- dataloaders
    @staticmethod
    def _world() -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def train_dataloader(self) -> DataLoader:
        self.build()
        world, rank = self._world()
        sampler = ResumableSampler(RowDataset(self.train_rows), seed=self.seed, shuffle=True,
                                   num_replicas=world, rank=rank)
        if self.drop_last and len(sampler) < self.batch_size:
            raise ValueError(
                f"{len(sampler)} training rows per rank is fewer than batch_size={self.batch_size}; "
                "with drop_last=True there would be no batch. Lower batch_size or add rows."
            )
        self._train_sampler = sampler
        if self._pending_position is not None:
            self._resume_sampler(*self._pending_position)
            self._pending_position = None
        loader = ResumableDataLoader(RowDataset(self.train_rows), batch_size=self.batch_size, sampler=sampler,
                                     collate_fn=collate_rows, num_workers=self.num_workers,
                                     drop_last=self.drop_last)
        loader.datamodule = self
        return loader

    def _eval_loader(self, rows: list[Row]) -> DataLoader:
        return DataLoader(RowDataset(rows), batch_size=self.batch_size, shuffle=False,
                          collate_fn=collate_rows, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self.build()
        return self._eval_loader(self.val_rows) if self.val_rows else []

    def test_dataloader(self) -> DataLoader | list:
        self.build()
        return self._eval_loader(self.test_rows) if self.test_rows else []

    # -------------------------------------------------------------- resume
    def _batches_consumed(self) -> tuple[int, int]:
        """(epoch, batches of that epoch already trained on)."""
        sampler = self._train_sampler
        if sampler is None:
            return self._pending_position or (0, 0)
        yielded = math.ceil(sampler.yielded / self.batch_size)
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit":
            # Lightning pre-fetches a batch; only the processed ones are consumed.
            processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            return sampler.epoch, min(yielded, processed)
        return sampler.epoch, yielded

    def state_dict(self) -> dict[str, Any]:
        """The data position: ``{"epoch", "batches_consumed", "batch_size", "seed", "num_train_rows"}``."""
        epoch, consumed = self._batches_consumed()
        return {
            "epoch": epoch,
            "batches_consumed": consumed,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "num_train_rows": len(self.train_rows) if self._built else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the saved position; the next ``train_dataloader()`` starts there."""
        for key in ("batch_size", "seed"):
            if state_dict.get(key) is not None and state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data position: checkpoint {key}={state_dict[key]} but "
                    f"this datamodule has {key}={getattr(self, key)}"
                )
        self.build()
        saved_rows = state_dict.get("num_train_rows")
        if saved_rows is not None and saved_rows != len(self.train_rows):
            raise ValueError(
                f"cannot resume the data position: checkpoint had {saved_rows} training rows, "
                f"now {len(self.train_rows)}"
            )
        position = (int(state_dict["epoch"]), int(state_dict["batches_consumed"]))
        if self._train_sampler is not None:
            self._resume_sampler(*position)
        else:
            self._pending_position = position

    def _resume_sampler(self, epoch: int, batches: int) -> None:
        sampler = self._train_sampler
        assert sampler is not None
        per_epoch = len(sampler) // self.batch_size if self.drop_last else math.ceil(len(sampler) / self.batch_size)
        if batches >= per_epoch:
            # A finished epoch resumes at the start of the next one. Deciding it here, not in
            # a later set_epoch, matters: with worker processes Lightning creates the resumed
            # iterator (which draws indices at once) before it calls set_epoch.
            epoch, batches = epoch + 1, 0
        sampler.resume(epoch, batches * self.batch_size)
