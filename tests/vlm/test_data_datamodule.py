"""PromptDataModule: batches of Rows, per-epoch deterministic shuffling, resumable data position."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.data.datamodule import PromptDataModule
from mmpo.data.loaders import save_rows_jsonl
from mmpo.data.synthetic import make_items

TASKS = ["count_shapes", "arithmetic"]


def _dm(**kwargs) -> PromptDataModule:
    args = dict(tasks=TASKS, train_size=16, val_size=4, seed=0, batch_size=4)
    args.update(kwargs)
    dm = PromptDataModule(**args)
    dm.setup("fit")
    return dm


def _ids(batches):
    return [[row["id"] for row in batch] for batch in batches]


def test_batches_are_lists_of_rows_and_sizes_are_split_over_tasks():
    dm = _dm(train_size=9, val_size=5, batch_size=2, test_size=2)
    assert [r["task"] for r in dm.train_rows].count("count_shapes") == 5  # 9 = 5 + 4
    assert len(dm.val_rows) == 5 and all("-val-" in r["id"] for r in dm.val_rows)
    assert len(dm.test_rows) == 2 and all("-test-" in r["id"] for r in dm.test_rows)
    batches = list(dm.train_dataloader())
    assert len(batches) == 4  # 9 rows, batch 2, drop_last
    assert all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], dict) for b in batches)
    assert [len(b) for b in dm.val_dataloader()] == [2, 2, 1]


def test_shuffle_is_deterministic_by_seed_and_changes_per_epoch():
    first = _ids(_dm().train_dataloader())
    assert first == _ids(_dm().train_dataloader())
    assert sorted(sum(first, [])) == sorted(r["id"] for r in _dm().train_rows)
    loader = _dm().train_dataloader()
    loader.sampler.set_epoch(1)
    assert _ids(loader) != first
    assert _ids(_dm(seed=1).train_dataloader()) != first


def test_resume_without_a_trainer_continues_at_the_next_batch():
    reference = _ids(_dm().train_dataloader())
    dm = _dm()
    iterator = iter(dm.train_dataloader())
    seen = [next(iterator) for _ in range(3)]
    state = dm.state_dict()
    assert state["epoch"] == 0 and state["batches_consumed"] == 3
    resumed = _dm()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives serialisation
    assert _ids(seen) + _ids(resumed.train_dataloader()) == reference


def test_resume_rejects_a_different_dataset():
    state = _dm().state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        _dm(batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="training rows"):
        _dm(train_size=20).load_state_dict(state)


def test_too_few_rows_for_a_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than batch_size"):
        _dm(train_size=3, batch_size=4).train_dataloader()


def test_data_path_rows_are_added_with_load_stats(tmp_path):
    path = save_rows_jsonl(make_items("bar_chart", 3, seed=9), tmp_path / "extra.jsonl")
    dm = _dm(tasks=[], data_path=str(path), batch_size=1)
    assert [r["task"] for r in dm.train_rows] == ["bar_chart"] * 3
    assert dm.load_stats["train"]["loaded"] == 3


class _RecordingModule(pl.LightningModule):
    """Records the row ids of every training batch; the loss is a zero-valued dummy."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append([row["id"] for row in batch])
        return self.weight.sum() * 0.0

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(max_steps, callbacks=()):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      val_check_interval=3, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_lightning_resume_continues_at_the_same_batch(tmp_path, num_workers):
    # 16 rows / batch 4 = 4 batches per epoch; 7 steps cross into the second epoch. With a
    # worker process the sampler runs ahead of training (prefetch): the saved position must not.
    step_ckpt = ModelCheckpoint(dirpath=tmp_path / "steps", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    val_ckpt = ModelCheckpoint(dirpath=tmp_path / "val", filename="val-{step}", save_top_k=-1)
    full = _RecordingModule()
    _trainer(7, [step_ckpt, val_ckpt]).fit(full, datamodule=_dm(num_workers=num_workers))
    assert len(full.seen) == 7
    assert sorted(sum(full.seen[:4], [])) == sorted(r["id"] for r in _dm().train_rows)  # epoch 0 = all rows
    # step 2: mid-epoch; step 4: end of epoch 0; step 5: inside epoch 1; val-step=3: saved after validation
    for ckpt in [tmp_path / "steps" / "step=2.ckpt", tmp_path / "steps" / "step=4.ckpt",
                 tmp_path / "steps" / "step=5.ckpt", tmp_path / "val" / "val-step=3.ckpt"]:
        done = int(ckpt.stem.split("=")[1])
        saved = torch.load(ckpt, weights_only=False)["PromptDataModule"]
        assert saved["batches_consumed"] == (done - 1) % 4 + 1, ckpt.name
        resumed = _RecordingModule()
        _trainer(7).fit(resumed, datamodule=_dm(num_workers=num_workers), ckpt_path=str(ckpt))
        assert resumed.seen == full.seen[done:], ckpt.name


def test_sampler_shards_ranks_disjointly_and_resumes_per_rank():
    from mmpo.data.datamodule import ResumableSampler, RowDataset

    dataset = RowDataset(list(range(10)))
    ranks = [ResumableSampler(dataset, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    orders = [list(s) for s in ranks]
    assert len(orders[0]) == len(orders[1]) == 5
    assert sorted(orders[0] + orders[1]) == list(range(10))
    ranks[1].resume(0, 2)  # skip this rank's first two indices, once
    assert list(ranks[1]) == orders[1][2:]
    assert list(ranks[1]) == orders[1]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_lightning_resume_twice_in_a_row(tmp_path):
    # Crash at step 2, resume and crash again at step 5, resume and finish at step 7.
    full = _RecordingModule()
    _trainer(7).fit(full, datamodule=_dm(num_workers=1))
    first = ModelCheckpoint(dirpath=tmp_path / "a", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    _trainer(2, [first]).fit(_RecordingModule(), datamodule=_dm(num_workers=1))
    second_run = _RecordingModule()
    second = ModelCheckpoint(dirpath=tmp_path / "b", filename="{step}", every_n_train_steps=5, save_top_k=-1)
    _trainer(5, [second]).fit(second_run, datamodule=_dm(num_workers=1), ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    third_run = _RecordingModule()
    _trainer(7).fit(third_run, datamodule=_dm(num_workers=1), ckpt_path=str(tmp_path / "b" / "step=5.ckpt"))
    assert second_run.seen == full.seen[2:5]
    assert third_run.seen == full.seen[5:7]
