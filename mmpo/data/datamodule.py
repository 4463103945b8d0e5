"""``PromptDataModule``: prompts (Rows) for SFT / RL from synthetic tasks and/or local files.

Batches are ``list[Row]`` (collation is the identity on a list). The training order and
its resumable position come from :mod:`mmpo.data.resumable`. Rows of local datasets
decode their images when the DataLoader reads them (per batch), never all at load time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from mmpo.data.lazy_rows import ConcatRows
from mmpo.data.loaders import ColumnKeys  # light: datasets / pyarrow are imported only when files are read
from mmpo.data.resumable import ResumableSampler, ResumableTrainData, RowDataset, collate_rows
from mmpo.data.schema import Row
from mmpo.data.synthetic import DEFAULT_IMAGE_SIZE, VISUAL_TASKS, make_items

logger = logging.getLogger(__name__)

#: init arguments the VLM LightningModules also have (stored under a ``data_`` prefix)
_SHARED_HPARAM_NAMES = ("seed", "system_prompt")


class PromptDataModule(ResumableTrainData, pl.LightningDataModule):
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
        prompt_key: column of the prompt in ``data_path`` / ``val_data_path`` (None: the first of
            ``query``, ``problem``, ``question``, ``prompt`` present).
        answer_key: column of the gold answer (None: ``answer``).
        image_key: column of the image(s) (None: the first of ``images``, ``decoded_image``, ``image``, ...).
        choices_key: column of multiple-choice options (None: ``choices`` or ``options`` when present).
        system_prompt: system turn for the file rows (None: the model's ``system_prompt``).
        format_prompt: EasyR1-style jinja template (a ``.jinja`` file or the text) wrapping each file
            row's prompt as ``{{ content }}``; None: the prompt as is.
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
        prompt_key: str | None = None,
        answer_key: str | None = None,
        image_key: str | None = None,
        choices_key: str | None = None,
        system_prompt: str | None = None,
        format_prompt: str | None = None,
    ) -> None:
        super().__init__()
        # stored in checkpoints next to the data position. The VLM modules have their own ``seed`` and
        # ``system_prompt``, and Lightning refuses to log equal names with different values, so
        # these are stored as ``data_seed`` / ``data_system_prompt``.
        self.save_hyperparameters(ignore=list(_SHARED_HPARAM_NAMES))
        self.hparams.update(data_seed=seed, data_system_prompt=system_prompt)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tasks = list(VISUAL_TASKS) if tasks is None else list(tasks)
        for name, path in (("data_path", data_path), ("val_data_path", val_data_path)):
            if path is not None and not str(path).strip():  # Path("") would silently mean the current folder
                raise ValueError(f"{name} is empty ({path!r}); give a dataset path or null for none")
        if not self.tasks and data_path is None:
            raise ValueError("no data: give synthetic tasks and/or data_path")
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.seed, self.difficulty, self.batch_size = seed, difficulty, batch_size
        self.data_path, self.val_data_path, self.image_root = data_path, val_data_path, image_root
        self.skip_bad_rows, self.num_workers = skip_bad_rows, num_workers
        self.image_size, self.drop_last = image_size, drop_last
        self.keys = ColumnKeys(prompt_key=prompt_key, answer_key=answer_key, image_key=image_key,
                               choices_key=choices_key, system_prompt=system_prompt, format_prompt=format_prompt)
        self.train_rows: Sequence[Row] = []
        self.val_rows: Sequence[Row] = []
        self.test_rows: Sequence[Row] = []
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

    def _from_file(self, path: str, key: str) -> Sequence[Row]:
        from mmpo.data.loaders import open_rows

        rows, stats = open_rows(path, skip_bad_rows=self.skip_bad_rows, image_root=self.image_root, keys=self.keys)
        self.load_stats[key] = stats
        if stats["skipped"]:
            logger.warning("%s: skipped %d bad rows of %d", path, stats["skipped"], stats["total"])
        if not rows:
            # not an error while synthetic tasks still supply rows, but never silent: the user asked for this data
            logger.warning("%s (%s): no rows loaded (%d in the file, %d skipped); %s", path, key, stats["total"],
                           stats["skipped"], f"using the synthetic tasks {self.tasks} only" if self.tasks
                           else "no other rows")
        return rows

    def build(self) -> None:
        """Generate / load all rows once (idempotent)."""
        if self._built:
            return
        # chained, not concatenated: a list would decode every file row's images now
        self.train_rows = self._synthetic(self.train_size, "train")
        if self.data_path is not None:
            self.train_rows = ConcatRows([self.train_rows, self._from_file(self.data_path, "train")])
        self.val_rows = self._synthetic(self.val_size, "val")
        if self.val_data_path is not None:
            self.val_rows = ConcatRows([self.val_rows, self._from_file(self.val_data_path, "val")])
        self.test_rows = self._synthetic(self.test_size, "test")
        if not self.train_rows:
            raise ValueError("the training set is empty (train_size=0 and no rows loaded from data_path)")
        self._built = True

    def setup(self, stage: str | None = None) -> None:
        self.build()

    # ---------------------------------------------------------- dataloaders
    def _training_rows(self) -> Sequence[Row]:
        self.build()
        return self.train_rows

    def _num_train_rows(self) -> int | None:
        return len(self.train_rows) if self._built else None

    def _eval_loader(self, rows: Sequence[Row]) -> DataLoader:
        return DataLoader(RowDataset(rows), batch_size=self.batch_size, shuffle=False,
                          collate_fn=collate_rows, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self.build()
        return self._eval_loader(self.val_rows) if self.val_rows else []

    def test_dataloader(self) -> DataLoader | list:
        self.build()
        return self._eval_loader(self.test_rows) if self.test_rows else []


class PreferenceDataModule(PromptDataModule):
    """Preference pairs for DPO-style training: training rows carry ``chosen`` and ``rejected``.

    Synthetic training rows get the rendered reference solution as ``chosen`` and the same reasoning
    ending in a wrong answer as ``rejected`` (``mmpo.data.preference.synthetic_preference_row``);
    ``data_path`` rows come from a local preference file (``load_preference_rows``, the same column
    overrides as prompt files plus ``chosen_key`` / ``rejected_key``). Validation and test rows stay
    plain prompts (held-out greedy accuracy needs answers, not pairs).

    Args:
        chosen_key: column of the preferred completion in ``data_path``.
        rejected_key: column of the dispreferred completion in ``data_path``.
        solution_style: how synthetic completions are rendered (think-answer or steps).
        **kwargs: every :class:`PromptDataModule` setting (tasks, train_size, data_path, keys, ...).
    """

    def __init__(self, chosen_key: str = "chosen", rejected_key: str = "rejected",
                 solution_style: str = "think-answer", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chosen_key, self.rejected_key, self.solution_style = chosen_key, rejected_key, solution_style

    def _synthetic(self, total: int, split: str) -> list[Row]:
        from mmpo.data.preference import synthetic_preference_row

        rows = super()._synthetic(total, split)
        if split != "train":
            return rows
        return [synthetic_preference_row(row, self.seed, style=self.solution_style) for row in rows]

    def _from_file(self, path: str, key: str) -> Sequence[Row]:
        if key != "train":
            return super()._from_file(path, key)
        from mmpo.data.preference import load_preference_rows

        rows, stats = load_preference_rows(path, keys=self.keys, chosen_key=self.chosen_key,
                                           rejected_key=self.rejected_key, image_root=self.image_root,
                                           skip_bad_rows=self.skip_bad_rows)
        self.load_stats[key] = stats
        if stats["skipped"]:
            logger.warning("%s: skipped %d bad preference rows of %d", path, stats["skipped"], stats["total"])
        if not rows:
            logger.warning("%s: no preference rows loaded (%d in the file)", path, stats["total"])
        return rows
