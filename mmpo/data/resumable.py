"""A training order that survives a restart, for any LightningDataModule of in-memory rows.

Training order is a per-epoch permutation seeded by ``seed + epoch`` (torch's
``DistributedSampler``, which also shards across DDP ranks), and the data position is
resumable: ``state_dict()`` records (epoch, batches consumed) and ``load_state_dict`` makes
the next train dataloader continue at the next unseen batch. Lightning stores the
datamodule's ``state_dict`` in every checkpoint and restores it on ``ckpt_path=...``.

Why "consumed" needs care: Lightning's fit loop pre-fetches one batch, so a sampler's own
count is one ahead when a checkpoint is written. Under a Trainer the consumed count is read
from the fit loop's batch progress (``processed`` batches of the current epoch); outside a
Trainer it is the number of batches yielded.

Used by ``mmpo.data.PromptDataModule`` (VLM prompts), the dLLM data modules and the robotics
BC ``ChunkDataModule`` (which indexes its own dataset and collates tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class RowDataset(Dataset):
    """A sequence of rows as a map-style dataset (a row is read only when its batch is built,
    so rows that decode their images on access, ``mmpo.data.lazy_rows``, stay lazy)."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows if isinstance(rows, Sequence) else list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]


def collate_rows(rows: list[Any]) -> list[Any]:
    """Identity collation: a batch is the list of its rows."""
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
    is not resumable. The position itself lives in the datamodule (one source of truth).
    """

    datamodule: ResumableTrainData | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict() if self.datamodule is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.datamodule is not None and state_dict:
            self.datamodule.load_state_dict(state_dict)


class ResumableTrainData:
    """Mixin for a LightningDataModule: a resumable, rank-sharded training DataLoader.

    The host class sets ``batch_size``, ``seed``, ``drop_last``, ``num_workers`` and
    ``_train_sampler = None`` / ``_pending_position = None`` in ``__init__``, and provides
    ``_training_rows()`` (the rows, built on first use) and ``_num_train_rows()`` (their count,
    or None before they exist, so ``state_dict`` never builds data).
    """

    batch_size: int
    seed: int
    drop_last: bool
    num_workers: int
    _train_sampler: ResumableSampler | None
    _pending_position: tuple[int, int] | None

    def _training_rows(self) -> Sequence[Any]:
        raise TypeError(f"{type(self).__name__} must define _training_rows() to use ResumableTrainData")

    def _num_train_rows(self) -> int | None:
        raise TypeError(f"{type(self).__name__} must define _num_train_rows() to use ResumableTrainData")

    @staticmethod
    def _world() -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    #: batch collation of the training loader (default: a batch is the list of its rows); a plain
    #: function, not a method, so worker processes do not pickle the datamodule
    train_collate_fn: Callable[[list[Any]], Any] = staticmethod(collate_rows)

    def _train_dataset(self) -> Dataset:
        """The map-style dataset the sampler indexes (default: the training rows as a list)."""
        return RowDataset(self._training_rows())

    def train_dataloader(self) -> DataLoader:
        rows = self._train_dataset()
        world, rank = self._world()
        sampler = ResumableSampler(rows, seed=self.seed, shuffle=True, num_replicas=world, rank=rank)
        if self.drop_last and len(sampler) < self.batch_size:
            raise ValueError(
                f"{len(sampler)} training rows per rank is fewer than batch_size={self.batch_size}; "
                "with drop_last=True there would be no batch. Lower batch_size or add rows."
            )
        self._train_sampler = sampler
        if self._pending_position is not None:
            self._resume_sampler(*self._pending_position)
            self._pending_position = None
        loader = ResumableDataLoader(rows, batch_size=self.batch_size, sampler=sampler, collate_fn=self.train_collate_fn,
                                     num_workers=self.num_workers, drop_last=self.drop_last)
        loader.datamodule = self
        return loader

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
            "num_train_rows": self._num_train_rows(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the saved position; the next ``train_dataloader()`` starts there."""
        for key in ("batch_size", "seed"):
            if state_dict.get(key) is not None and state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data position: checkpoint {key}={state_dict[key]} but "
                    f"this datamodule has {key}={getattr(self, key)}"
                )
        num_rows = len(self._training_rows())
        saved_rows = state_dict.get("num_train_rows")
        if saved_rows is not None and saved_rows != num_rows:
            raise ValueError(
                f"cannot resume the data position: checkpoint had {saved_rows} training rows, now {num_rows}"
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
