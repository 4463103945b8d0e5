"""DPOModule: sequence log-probs (parity with HF's logits), the step-0 loss, learning, the reference
computed once (and carried by checkpoints), config errors, and a 2-step `mmpo fit` of dpo_tiny.yaml."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from mmpo.algos.dpo import DPOModule
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.datamodule import PreferenceDataModule
from mmpo.data.synthetic import corpus
from mmpo.training.config import OptimConfig
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.logprobs import sequence_inputs
from mmpo.vlm.processing import encode_completions, encode_prompts, model_inputs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["arithmetic", "bar_chart"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def _datamodule(train_size: int = 4) -> PreferenceDataModule:
    dm = PreferenceDataModule(tasks=["arithmetic", "bar_chart"], train_size=train_size, val_size=2, batch_size=2,
                              seed=0)
    dm.setup("fit")
    return dm


def test_pair_log_probs_match_hf_logits(tiny_path):
    module = DPOModule(tiny_path)
    rows = list(_datamodule().train_rows)[:2]
    chosen, rejected, chosen_len, rejected_len = module.pair_log_probs(module.model, rows)
    prompts = encode_prompts(module.processor, rows, system_prompt=module.system_prompt)
    for key, logps, lengths in (("chosen", chosen, chosen_len), ("rejected", rejected, rejected_len)):
        ids, mask = encode_completions(module.processor, [r[key] for r in rows])
        inputs = sequence_inputs(prompts, ids, mask)
        logits = module.model(**model_inputs(inputs)).logits[:, prompts["input_ids"].shape[1] - 1 : -1]
        per_token = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logps, (per_token * mask).sum(-1), atol=1e-4, rtol=1e-5)
        assert lengths.tolist() == mask.sum(-1).tolist()
    assert not torch.equal(chosen, rejected)


def test_first_step_is_log2_and_training_separates_the_pairs(tiny_path):
    dm = _datamodule()
    module = DPOModule(tiny_path, optim=OptimConfig(lr=5e-3), beta=0.5)
    module.precompute_reference(dm.train_rows)
    assert len(module.ref_log_probs) == 4
    rows = list(dm.train_rows)
    loss, metrics = module.dpo_loss(rows)
    # policy == reference: Delta = 0 -> -log sigma(0) = log 2 and implicit rewards 0 (up to float noise
    # between the reference's batches and this one, so rewards/accuracies is not asserted here)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    loss, metrics = module.dpo_loss(rows)
    assert loss.item() < 0.5 * math.log(2), metrics
    assert metrics["rewards/accuracies"] == 1.0 and metrics["rewards/margins"] > 0.5


def test_rpo_alpha_combined_loss_by_hand(tiny_path, monkeypatch):
    # hand sequence log-probs for two pairs: chosen -1 (2 tokens), -2 (4 tokens); rejected -3, -1;
    # reference -2 / -2 and -1.5 / -1.5 -> Delta = 2 and -1; beta 0.5:
    # DPO = (log(1 + e^-1) + log(1 + e^0.5)) / 2 = 0.6436694; chosen NLL = (1 + 2) / (2 + 4) = 0.5;
    # rpo_alpha 1: loss = 1.1436694
    module = DPOModule(tiny_path, beta=0.5, rpo_alpha=1.0)
    rows = [{"id": "a"}, {"id": "b"}]
    module.ref_log_probs = {"a": (-2.0, -2.0), "b": (-1.5, -1.5)}
    hand = (torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]), torch.tensor([2, 4]), torch.tensor([3, 5]))
    monkeypatch.setattr(DPOModule, "pair_log_probs", lambda self, model, batch: hand)
    loss, metrics = module.dpo_loss(rows)
    dpo = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2
    assert loss.item() == pytest.approx(dpo + 0.5, rel=1e-6)
    assert metrics["losses/preference"] == pytest.approx(dpo, rel=1e-6)
    assert metrics["losses/sft"] == pytest.approx(0.5)
    module.hparams.rpo_alpha = 0.0  # off: the same NLL is logged, the loss is DPO's
    loss, metrics = module.dpo_loss(rows)
    assert loss.item() == pytest.approx(dpo, rel=1e-6) and metrics["losses/sft"] == pytest.approx(0.5)


def test_rpo_alpha_raises_the_chosen_likelihood(tiny_path):
    # the same pairs, steps and lr: with the NLL term the chosen completions end more likely than without
    dm = _datamodule()
    rows = list(dm.train_rows)
    nll = {}
    for alpha in (0.0, 1.0):
        torch.manual_seed(0)
        module = DPOModule(tiny_path, optim=OptimConfig(lr=5e-3), beta=0.5, rpo_alpha=alpha)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, datamodule=_datamodule())
        nll[alpha] = module.dpo_loss(rows)[1]["losses/sft"]
    assert nll[1.0] < nll[0.0], nll


def test_reference_is_not_recomputed_and_survives_a_checkpoint(tiny_path):
    dm = _datamodule()
    module = DPOModule(tiny_path)
    module.precompute_reference(dm.train_rows)
    saved = dict(module.ref_log_probs)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    with torch.no_grad():  # a trained policy: the reference must still be the initial one
        for p in module.model.parameters():
            p.add_(0.1)
    fresh = DPOModule(tiny_path)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.ref_log_probs.keys() == saved.keys()
    for key, (c, r) in saved.items():
        assert fresh.ref_log_probs[key] == pytest.approx((c, r), rel=1e-6)
    fresh.on_fit_start()  # restored: returns before reading any datamodule (there is no trainer here)
    with pytest.raises(KeyError, match="no reference log-probs for pair"):
        fresh._reference_for([{"id": "unknown"}])
    with pytest.raises(ValueError, match="duplicate pair id"):
        module.precompute_reference(list(dm.train_rows)[:1])


def test_config_errors(tiny_path):
    with pytest.raises(ValueError, match=r"unknown preference loss 'dpo'"):
        DPOModule(tiny_path, loss_type="dpo")
    with pytest.raises(ValueError, match="length_normalize .* needs loss_type 'ipo'"):
        DPOModule(tiny_path, length_normalize=True)
    with pytest.raises(ValueError, match="rpo_alpha must be >= 0"):
        DPOModule(tiny_path, rpo_alpha=-0.5)
    module = DPOModule(tiny_path)
    with pytest.raises(ValueError, match="no 'chosen' / 'rejected' completion"):
        module.pair_log_probs(module.model, [{"id": "a", "problem": "hi", "images": []}])


def test_dpo_tiny_config_fits_two_steps(tiny_path, tmp_path, fit_preference_config):
    rows = fit_preference_config("dpo_tiny.yaml", tiny_path, tmp_path)
    steps = [r for r in rows if r.get("rewards/margins")]
    assert len(steps) == 2
    # step 1 runs at the initial weights: the reference, so every margin is 0 and the loss log 2
    assert float(steps[0]["rewards/margins"]) == pytest.approx(0.0, abs=1e-5)
    assert float(steps[0]["losses/preference"]) == pytest.approx(math.log(2), abs=1e-5)


def test_resumed_fit_keeps_the_initial_reference(tiny_path, tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(steps):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])

    first = DPOModule(tiny_path, optim=OptimConfig(lr=5e-3))
    trainer(2).fit(first, datamodule=_datamodule())
    computed = dict(first.ref_log_probs)
    calls = []
    monkeypatch.setattr(DPOModule, "precompute_reference", lambda self, rows: calls.append(len(rows)))
    resumed = DPOModule(tiny_path, optim=OptimConfig(lr=5e-3))  # the initial weights again, then the checkpoint's
    trainer(4).fit(resumed, datamodule=_datamodule(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert calls == []  # not recomputed by the trained weights: restored from the checkpoint
    assert resumed.ref_log_probs.keys() == computed.keys()
    for key, values in computed.items():
        assert resumed.ref_log_probs[key] == pytest.approx(values, rel=1e-6)
