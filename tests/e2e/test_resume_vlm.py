"""Resume: N + M GRPO steps straight == N steps, a fresh Trainer from the checkpoint, M steps.

Compares the final weights bit for bit, the per-step losses, and the prompts seen after the
restart (data position), across an epoch boundary, with an LR schedule, AdamW moments, a
reference model (beta > 0), inner epochs with minibatches, and sampled rollouts.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.algos.grpo import GRPOModule
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.datamodule import PromptDataModule
from mmpo.data.synthetic import corpus
from mmpo.training.config import LossConfig, OptimConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm

N_STEPS, M_STEPS = 2, 2
OPT_STEPS_PER_BATCH = 2  # mu = 2 epochs x (2 prompts x G 2 / minibatch 4)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


class Recorder(L.Callback):
    """Row ids of every batch and the loss logged after it."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append([row["id"] for row in batch])
        self.losses.append(pl_module.last_metrics["losses/policy"])


def _module(tiny_path):
    return GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2, max_new_tokens=4),
                      optim=OptimConfig(lr=1e-3, warmup_steps=3, lr_schedule="linear", mu=2, minibatch_size=4),
                      loss=LossConfig(beta=0.05, clip_high=0.28), seed=7)


def _data():
    # 6 rows, 2 per batch: 3 batches per epoch, so the restart at batch 2 and the run cross an epoch
    return PromptDataModule(tasks=["count_shapes", "arithmetic"], train_size=6, val_size=2, seed=3, batch_size=2)


def _trainer(root, batches, callbacks):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=batches * OPT_STEPS_PER_BATCH, default_root_dir=root,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, callbacks=callbacks)


def test_resume_matches_uninterrupted_run(tiny_path, tmp_path):
    straight = Recorder()
    module = _module(tiny_path)
    _trainer(tmp_path / "a", N_STEPS + M_STEPS, [straight]).fit(module, datamodule=_data())
    expected = {n: p.detach().clone() for n, p in module.model.named_parameters()}

    first = Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=N_STEPS * OPT_STEPS_PER_BATCH,
                                 save_last=True, save_top_k=-1)
    _trainer(tmp_path / "b", N_STEPS, [first, checkpoint]).fit(_module(tiny_path), datamodule=_data())
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file()

    # a fresh module, datamodule and Trainer, as after a hard kill
    second = Recorder()
    resumed = _module(tiny_path)
    _trainer(tmp_path / "c", N_STEPS + M_STEPS, [second]).fit(resumed, datamodule=_data(), ckpt_path=str(ckpt))

    assert first.batches == straight.batches[:N_STEPS]
    assert second.batches == straight.batches[N_STEPS:], "data position not restored"
    assert len({i for b in straight.batches[:3] for i in b}) == 6  # a full epoch, no repeats
    assert first.losses + second.losses == straight.losses
    assert resumed.trainer.global_step == (N_STEPS + M_STEPS) * OPT_STEPS_PER_BATCH
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
    # the learning-rate schedule continued rather than restarting
    assert resumed.optimizers().param_groups[0]["lr"] == module.optimizers().param_groups[0]["lr"]
