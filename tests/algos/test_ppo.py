"""PPOModule (mmpo.algos.ppo): GAE over the value model's values on hand values, the value loss reaching only the
critic, and exact resume (policy, critic and their optimizer state)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.algos.ppo import PPOModule, TokenValueModel
from mmpo.core import Aggregation
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.datamodule import PromptDataModule
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, RewardConfig, SamplingConfig, ValueModelConfig
from mmpo.vlm.factory import build_tiny_vlm, load_vlm


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def _module(tiny_path, **kwargs):
    settings = dict(sampling=SamplingConfig(num_generations=2, max_new_tokens=4),
                    optim=OptimConfig(lr=1e-3, mu=2, minibatch_size=2), loss=LossConfig(beta=0.0),
                    rewards=RewardConfig(timeout_s=None), seed=3,
                    critic=ValueModelConfig(lr=1e-3, warmup_steps=1, cliprange_value=0.2))
    settings.update(kwargs)
    return PPOModule(tiny_path, **settings)


def test_advantages_are_reward_minus_constant_value(tiny_path):
    module = _module(tiny_path, whiten_advantages=False, gamma=1.0, lam=1.0)
    with torch.no_grad():  # V = 0.25 everywhere: the head reads nothing and has bias 0.25
        module.value_model.head.weight.zero_()
        module.value_model.head.bias.fill_(0.25)
    rollout = module.build_rollout(make_items("count_shapes", 2, seed=0))
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
    advantages, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    mask = rollout.completion_mask.float()
    # gamma = lam = 1, outcome reward: A_t = R - V_t = R - 0.25 on every real token; returns R
    torch.testing.assert_close(advantages, (rewards[:, None] - 0.25) * mask)
    torch.testing.assert_close(rollout.extras["ppo_returns"], rewards[:, None] * mask)
    torch.testing.assert_close(rollout.extras["ppo_values"], 0.25 * mask)
    assert metrics["critic/values_mean"] == pytest.approx(0.25)
    # whitened (the default): zero mean, unit (Bessel) variance over the real tokens
    module.hparams.whiten_advantages = True
    whitened, _ = module.compute_advantages(rewards, rollout.group_ids, rollout)
    real = whitened[mask > 0]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-6) and float(real.var()) == pytest.approx(1.0, abs=1e-4)


def test_value_loss_term_trains_only_the_critic(tiny_path):
    module = _module(tiny_path)
    with torch.no_grad():
        module.value_model.head.weight.zero_()
        module.value_model.head.bias.fill_(0.5)
    rollout = module.build_rollout(make_items("count_shapes", 1, seed=1))
    mask = rollout.completion_mask.float()
    rollout.extras["ppo_values"] = 0.5 * mask
    rollout.extras["ppo_returns"] = torch.tensor([[1.0], [0.0]]) * mask
    outputs = {"mask": mask, "aggregation": Aggregation("token-mean", float(mask.sum()))}
    parts, metrics = module.extra_loss_terms(rollout, outputs)
    # V = 0.5 and R in {1, 0}: every token's (V - R)^2 is 0.25, the clipped term the same: loss 0.5 * 0.25
    assert float(parts["value"].detach()) == pytest.approx(0.125)
    assert parts.coefficient("value") == 1.0 and metrics["value/clipfrac"] == 0.0
    parts["value"].backward()
    assert module.value_model.head.bias.grad is not None
    assert all(p.grad is None for p in module.model.parameters())
    # d/db 0.5 * mean((b - R)^2) = mean(b - R) over the real tokens
    expected = float(((0.5 - rollout.extras["ppo_returns"]) * mask).sum() / mask.sum())
    assert float(module.value_model.head.bias.grad) == pytest.approx(expected)


def test_ppo_refuses_an_advantage_estimator(tiny_path):
    with pytest.raises(ValueError, match="leave `advantage` unset"):
        _module(tiny_path, advantage=AdvantageConfig(name="rloo"))


def test_value_model_save_and_load_round_trip(tiny_path, tmp_path):
    model = TokenValueModel.load(tiny_path, head_init_std=0.02, seed=5)
    again = TokenValueModel.load(tiny_path, head_init_std=0.02, seed=5)
    assert torch.equal(model.head.weight, again.head.weight) and float(model.head.weight.std()) > 0
    model.save(tmp_path / "vm", load_vlm(tiny_path)[1])
    loaded = TokenValueModel.load(tmp_path / "vm", head_init_std=0.0)
    assert torch.equal(loaded.head.weight, model.head.weight)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append((pl_module.last_metrics["losses/policy"], pl_module.last_metrics["losses/value"]))


def _trainer(root, steps, callbacks):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=root, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, callbacks=callbacks)


def _data():
    return PromptDataModule(tasks=["count_shapes", "arithmetic"], train_size=4, val_size=2, seed=3, batch_size=1)


def test_resume_matches_uninterrupted_run(tiny_path, tmp_path):
    # 2 optimizer steps per batch (mu 2 x one minibatch of 2); the first is the critic's warm-up; KL in the reward
    kwargs = dict(kl_coef=0.05)
    straight = Recorder()
    module = _module(tiny_path, **kwargs)
    _trainer(tmp_path / "a", 6, [straight]).fit(module, datamodule=_data())

    first = Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1)
    _trainer(tmp_path / "b", 2, [first, checkpoint]).fit(_module(tiny_path, **kwargs), datamodule=_data())
    second = Recorder()
    resumed = _module(tiny_path, **kwargs)
    _trainer(tmp_path / "c", 6, [second]).fit(resumed, datamodule=_data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))

    assert first.losses + second.losses == straight.losses
    for (name, param), expected in zip(resumed.named_parameters(), module.parameters()):
        assert torch.equal(param, expected), name
    state, expected_state = resumed.optimizers().optimizer.state_dict(), module.optimizers().optimizer.state_dict()
    for key, value in expected_state["state"].items():
        assert torch.equal(state["state"][key]["exp_avg"], value["exp_avg"])


def test_lora_critic_trains_only_its_adapter_and_head(tiny_path, tmp_path):
    module = _module(tiny_path, critic=ValueModelConfig(lr=1e-2, lora_rank=4, lora_alpha=8, warmup_steps=1),
                     optim=OptimConfig(lr=1e-3))
    trainable = {n for n, p in module.value_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    frozen = {n: p.detach().clone() for n, p in module.value_model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in module.value_model.named_parameters() if p.requires_grad}
    data = PromptDataModule(tasks=["count_shapes"], train_size=2, val_size=2, seed=0, batch_size=1)
    _trainer(tmp_path, 1, []).fit(module, datamodule=data)
    after = dict(module.value_model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())
    assert any(not torch.equal(after[n], v) for n, v in trained.items())
    groups = module.optimizers().optimizer.param_groups
    assert sum(p.numel() for p in groups[1]["params"]) == sum(after[n].numel() for n in trainable)
