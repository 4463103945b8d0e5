"""BC pre-training: EMA arithmetic, the epsilon-MSE loss decreasing, a Lightning fit with checkpoint reload."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmpo.robotics.bc import BCModule, make_ema
from mmpo.robotics.policy.io import load_policy

torch.set_num_threads(1)


def test_ema_update_hand_computed():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    ema = make_ema(model, decay=0.995)  # starts as a copy: 2.0
    with torch.no_grad():
        model.weight.fill_(4.0)
    ema.update_parameters(model)
    # 0.995 * 2 + 0.005 * 4 = 1.99 + 0.02 = 2.01
    assert ema.module.weight.item() == pytest.approx(2.01)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema.update_parameters(model)
    # 0.995 * 2.01 + 0.005 * 0 = 1.99995
    assert ema.module.weight.item() == pytest.approx(1.99995)
    with pytest.raises(ValueError, match="decay"):
        make_ema(model, decay=1.0)


def _tiny_chunks(num: int = 64) -> TensorDataset:
    # a deterministic expert: the chunk is a function of the observation (a_k = tanh(obs . w_k))
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(num, 3, generator=generator) * 2 - 1
    weights = torch.randn(3, 4 * 2, generator=generator)
    actions = torch.tanh(obs @ weights).view(num, 4, 2)
    return TensorDataset(obs, actions)


def _module(**kwargs) -> BCModule:
    torch.manual_seed(0)
    defaults = dict(obs_dim=3, action_dim=2, horizon=4, act_steps=4, denoising_steps=8,
                    hidden_dims=[64, 64, 64], lr=3e-3, lr_min=3e-3, warmup_steps=1, export_safetensors=False)
    defaults.update(kwargs)
    return BCModule(**defaults)


def _mean_loss(policy, dataset: TensorDataset, seed: int = 123) -> float:
    torch.manual_seed(seed)  # same timesteps and noise for both evaluations
    obs, actions = dataset.tensors
    with torch.no_grad():
        return sum(policy.bc_loss(obs, actions).item() for _ in range(20)) / 20


def test_bc_loss_decreases_and_checkpoint_reloads_the_ema_policy(tmp_path):
    dataset = _tiny_chunks()
    module = _module()
    before = _mean_loss(module.policy, dataset)
    trainer = pl.Trainer(max_epochs=40, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False)
    trainer.fit(module, DataLoader(dataset, batch_size=16, shuffle=True))
    after = _mean_loss(module.policy, dataset)
    assert after < 0.5 * before, (before, after)
    ema_after = _mean_loss(module.ema_policy.module, dataset)
    assert ema_after < before
    # EMA weights differ from the raw weights (160 updates with decay 0.995 lag behind)
    raw = module.policy.network.body.output.weight
    ema = module.ema_policy.module.network.body.output.weight
    assert not torch.allclose(raw, ema)
    path = tmp_path / "bc.ckpt"
    trainer.save_checkpoint(path)
    policy, metadata = load_policy(path)
    assert metadata["kind"] == "bc" and metadata["ft_steps"] == 0 and metadata["act_steps"] == 4
    assert torch.equal(policy.network.body.output.weight, ema)
    # the BC policy imitates: deterministic samples land near the expert chunks
    obs, actions = dataset.tensors
    predicted = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    assert (predicted - actions).abs().mean().item() < (actions - actions.mean(0)).abs().mean().item()


def test_bc_module_rejects_inconsistent_act_steps():
    with pytest.raises(ValueError, match="act_steps"):
        _module(act_steps=5)
