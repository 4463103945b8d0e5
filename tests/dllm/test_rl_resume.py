"""Resume of DiffuGRPO/IGPO: N + M batches straight == N batches, a fresh Trainer from the checkpoint, M batches.

Compares the final weights bit for bit, the per-batch losses and the prompts seen after the
restart (data position), across an epoch boundary, with a warm-up LR schedule, AdamW moments,
the KL reference (beta > 0), IGPO's hinted regeneration (a random-init model gets every group
wrong) and the structured estimator's per-step timesteps.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.dllm.data import ArithmeticDataModule
from mmpo.dllm.hints import HintConfig
from mmpo.dllm.modeling import save_mask_predictor
from mmpo.dllm.rl import DiffuGRPO
from mmpo.dllm.sampler import SamplerConfig

N_BATCHES, M_BATCHES = 2, 2
INNER = 2


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append([row["problem"] for row in batch])
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _module(path: str, save_dir: str) -> DiffuGRPO:
    return DiffuGRPO(
        model_path=path, warmup_config=None, save_dir=save_dir, group_size=4,
        optim={"mu": INNER, "lr": 1e-3, "warmup_steps": 3}, loss={"beta": 0.05},
        igpo={"enabled": True, "max_replacements": 2},
        logprob={"masking": "structured", "diffusion_steps": 16, "min_timestep": 4},
        sampler=SamplerConfig(gen_length=16, block_length=8, steps=8, temperature=1.2),
        hints=HintConfig(min_chunk=2, max_chunk=4, free_tail=2), seed=5,
    )


def _data() -> ArithmeticDataModule:
    # 6 rows, 2 per batch: 3 batches per epoch, so the restart at batch 2 and the run cross an epoch
    return ArithmeticDataModule(train_size=6, test_size=4, val_size=2, batch_size=2, seed=3)


def _trainer(root, batches, callbacks) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=batches * INNER, default_root_dir=root, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, callbacks=callbacks)


def test_igpo_resume_matches_uninterrupted_run(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    start = tmp_path / "start"
    save_mask_predictor(model, tokenizer, start)

    straight = Recorder()
    module = _module(str(start), str(tmp_path / "a_model"))
    _trainer(tmp_path / "a", N_BATCHES + M_BATCHES, [straight]).fit(module, datamodule=_data())
    expected = {n: p.detach().clone() for n, p in module.model.named_parameters()}

    first = Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=N_BATCHES * INNER, save_last=True,
                                 save_top_k=-1)
    _trainer(tmp_path / "b", N_BATCHES, [first, checkpoint]).fit(_module(str(start), str(tmp_path / "b_model")),
                                                                 datamodule=_data())
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file()

    second = Recorder()  # a fresh module, datamodule and Trainer, as after a hard kill
    resumed = _module(str(start), str(tmp_path / "c_model"))
    _trainer(tmp_path / "c", N_BATCHES + M_BATCHES, [second]).fit(resumed, datamodule=_data(), ckpt_path=str(ckpt))

    assert first.batches == straight.batches[:N_BATCHES]
    assert second.batches == straight.batches[N_BATCHES:], "data position not restored"
    assert len({p for b in straight.batches[:3] for p in b}) == 6  # a full epoch, no repeats
    assert first.losses + second.losses == straight.losses
    assert resumed.trainer.global_step == (N_BATCHES + M_BATCHES) * INNER
    changed = False
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
        changed |= not torch.equal(param, model.state_dict()[name]) if name in model.state_dict() else False
    assert changed, "training did not move the weights: the comparison would be vacuous"
    assert resumed.optimizers().param_groups[0]["lr"] == module.optimizers().param_groups[0]["lr"]
