"""T-PPO through the module path: windows carried across steps (EOS suppressed, so the schedule is
known), extended-GAE advantages with a constant critic by hand, the in-flight state through a
weights-only checkpoint, resume == uninterrupted run, and an `mmpo fit` smoke run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.data.datamodule import PromptDataModule
from mmpo.data.synthetic import make_items
from mmpo.training.config import merged_settings


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("tppo_model"), corpus=corpus)


def _module(tiny_model, **overrides):
    from mmpo.algos.tppo import TPPOModule

    # critic None: the value head on the policy's detached states (the value-model critic: the tests at the end)
    settings = dict(sampling={"num_generations": 2, "max_new_tokens": 7}, window_len=3, loss={"beta": 0.0},
                    optim={"lr": 1e-3}, value_lr=1e-2, seed=5, critic=None)
    return TPPOModule(str(tiny_model), **merged_settings(settings, overrides))


def _no_eos(module):
    module.model.generation_config.suppress_tokens = [module.engine.eos_token_id, *module.engine.forbidden_ids]
    return module


def test_windows_carry_over_until_the_budget(tiny_model):
    module = _no_eos(_module(tiny_model))
    rows = make_items("count_shapes", 1, seed=4)
    torch.manual_seed(0)
    first = module.build_rollout(rows)  # 2 fresh responses, 3 tokens each, none ended
    assert first.extras["tppo_completed"].tolist() == [False, False]
    assert [len(i["tokens"]) for i in module.inflight.items] == [3, 3]
    carried = [i["tokens"].clone() for i in module.inflight.items]
    second = module.build_rollout(rows)  # 2 fresh + 2 carried (now 6 of 7 tokens)
    assert second.extras["tppo_prefix_len"].tolist() == [0, 0, 3, 3]
    assert second.extras["tppo_completed"].tolist() == [False] * 4
    assert [len(i["tokens"]) for i in module.inflight.items] == [3, 3, 6, 6]
    for k in range(2):  # a carried response continues its own tokens, and its prompt holds them
        assert module.inflight.items[2 + k]["tokens"][:3].tolist() == carried[k].tolist()
        assert second.prompt_inputs["input_ids"][2 + k, -3:].tolist() == carried[k].tolist()
    third = module.build_rollout(rows)  # the 6-token responses get their last token and complete
    assert third.extras["tppo_prefix_len"].tolist() == [0, 0, 3, 3, 6, 6]
    assert third.completion_mask.sum(-1).tolist() == [3, 3, 3, 3, 1, 1]
    assert third.extras["tppo_completed"].tolist() == [False] * 4 + [True, True]
    assert len(module.inflight.items) == 4


def test_advantages_with_a_constant_critic(tiny_model):
    module = _no_eos(_module(tiny_model))
    torch.nn.init.constant_(module.value_head.bias, 0.5)  # V = 0.5 everywhere
    rows = make_items("count_shapes", 1, seed=4)
    torch.manual_seed(0)
    module.build_rollout(rows)
    module.build_rollout(rows)
    rollout = module.build_rollout(rows)
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    adv, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    mask = rollout.completion_mask.float()
    # truncated rows: deltas 0.5 - 0.5 = 0 (bootstrap V = 0.5) -> A = 0
    # completed rows (gamma = lam = 1): A = R - V = 1 - 0.5 = 0.5 and 0 - 0.5 = -0.5 on their one token
    torch.testing.assert_close(adv[:4], torch.zeros(4, adv.shape[1]))
    assert adv[4, 0].item() == pytest.approx(0.5) and adv[5, 0].item() == pytest.approx(-0.5)
    # critic targets: the returns of completed rows only
    torch.testing.assert_close(rollout.extras["tppo_value_mask"], mask * torch.tensor([0, 0, 0, 0, 1, 1.0]).unsqueeze(1))
    assert rollout.extras["tppo_returns"][4, 0].item() == pytest.approx(1.0)
    assert metrics["tppo/completed_frac"] == pytest.approx(2 / 6)
    assert metrics["tppo/value_mean"] == pytest.approx(0.5)


def test_inflight_state_round_trips_a_weights_only_checkpoint(tiny_model):
    module = _no_eos(_module(tiny_model))
    torch.manual_seed(0)
    module.build_rollout(make_items("count_shapes", 2, seed=4))
    assert len(module.inflight.items) == 4
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = _module(tiny_model)
    fresh.on_load_checkpoint(loaded)
    assert len(fresh.inflight.items) == 4
    for a, b in zip(module.inflight.items, fresh.inflight.items):
        assert torch.equal(a["tokens"], b["tokens"])
        assert a["row"]["id"] == b["row"]["id"] and a["row"]["answer"] == b["row"]["answer"]
        assert [im.tobytes() for im in a["row"]["images"]] == [im.tobytes() for im in b["row"]["images"]]


def _trainer(root, steps, callbacks):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=root, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                     callbacks=callbacks)


def _data():
    return PromptDataModule(tasks=["count_shapes"], train_size=6, val_size=2, seed=3, batch_size=1)


@pytest.mark.parametrize("critic", ["head", "value model"])
def test_resume_restores_inflight_responses(tiny_model, tmp_path, critic):
    # 3 steps straight == 2 steps, a checkpoint, a fresh module and Trainer, 1 step; the third step continues
    # the responses in flight at the checkpoint, so losing them would change the weights (the value model's too)
    make = _module if critic == "head" else _critic_module
    straight = make(tiny_model)
    _trainer(tmp_path / "a", 3, []).fit(straight, datamodule=_data())

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1)
    _trainer(tmp_path / "b", 2, [checkpoint]).fit(make(tiny_model), datamodule=_data())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert len(saved["tppo_inflight"]) > 0
    resumed = make(tiny_model)
    _trainer(tmp_path / "c", 3, []).fit(resumed, datamodule=_data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.last_metrics["tppo/carried"] == straight.last_metrics["tppo/carried"] > 0
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_tppo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0])
    rows = fit_vlm_config("variants/tppo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.window_len=3",
                          "--model.init_args.sampling.num_generations=2", f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("tppo/completed_frac")]
    assert len(logged) == 2
    assert float(logged[1]["tppo/carried"]) >= 0
    assert all("losses/value" in r for r in logged)


def _critic_module(tiny_model, **overrides):
    from mmpo.algos.tppo import TPPOModule

    settings = dict(sampling={"num_generations": 2, "max_new_tokens": 7}, window_len=3, loss={"beta": 0.0},
                    optim={"lr": 1e-3}, seed=5, critic={"lr": 2e-3, "weight_decay": 0.05})
    return TPPOModule(str(tiny_model), **merged_settings(settings, overrides))


def test_the_default_critic_is_ppos_value_model(tiny_model):
    from mmpo.algos.ppo import TokenValueModel

    module = _no_eos(_critic_module(tiny_model))
    assert isinstance(module.value_model, TokenValueModel) and module.value_head is None
    assert module.hparams["critic"]["lr"] == 2e-3  # a plain dict: weights-only checkpoints load it
    groups = module.configure_optimizers()["optimizer"].param_groups
    assert [g["lr"] for g in groups] == [1e-3, 2e-3] and groups[1]["weight_decay"] == 0.05
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in module.value_model.parameters() if p.requires_grad}
    # the separate value model starts from the policy's weights, not from the policy's tensors
    assert all(a is not b for a, b in zip(module.value_model.backbone.parameters(), module.model.parameters()))


def test_value_model_state_values_extend_its_token_values(tiny_model):
    module = _no_eos(_critic_module(tiny_model))
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("count_shapes", 1, seed=4))
    with torch.no_grad():
        states = module.value_model.state_values(rollout)
        tokens = module.value_model(rollout)
    assert states.shape == (len(rollout), rollout.completion_ids.shape[1] + 1)
    # the first T columns are V(s_t) before each completion token: the value model's own per-token values
    torch.testing.assert_close(states[:, :-1], tokens, atol=1e-5, rtol=1e-5)


def test_advantages_with_a_constant_value_model(tiny_model):
    module = _no_eos(_critic_module(tiny_model))
    torch.nn.init.zeros_(module.value_model.head.weight)
    torch.nn.init.constant_(module.value_model.head.bias, 0.5)  # V = 0.5 everywhere
    rows = make_items("count_shapes", 1, seed=4)
    torch.manual_seed(0)
    module.build_rollout(rows)
    module.build_rollout(rows)
    rollout = module.build_rollout(rows)
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    adv, _ = module.compute_advantages(rewards, rollout.group_ids, rollout)
    # as with the head: truncated rows bootstrap 0.5 -> A = 0; completed rows A = R - 0.5 on their one token
    torch.testing.assert_close(adv[:4], torch.zeros(4, adv.shape[1]))
    assert adv[4, 0].item() == pytest.approx(0.5) and adv[5, 0].item() == pytest.approx(-0.5)
    # the critic's loss trains the value model (its head gets a gradient), never the policy
    parts, _ = module.extra_loss_terms(rollout, {"mask": rollout.completion_mask.float(),
                                                 "aggregation": lambda x, m: (x * m).sum() / m.sum()})
    total = parts.total()
    total.backward()
    # completed rows' targets: returns = A + V = R; error 0.5 (V - R)^2 = 0.125 on both of their tokens
    assert float(total) == pytest.approx(0.125)
    assert module.value_model.head.bias.grad is not None
    assert all(p.grad is None for p in module.model.parameters())


@pytest.mark.parametrize("critic, value_lr, message", [
    ({"lr": 1e-3}, 1e-2, "critic.lr"), ({"frozen": True}, None, "frozen, warmup_steps and lora_rank")])
def test_critic_settings_t_ppo_does_not_read_fail_in_one_line(tiny_model, critic, value_lr, message):
    from mmpo.algos.tppo import TPPOModule

    with pytest.raises(ValueError, match=message):
        TPPOModule(str(tiny_model), sampling={"num_generations": 2, "max_new_tokens": 7}, window_len=3,
                   critic=critic, value_lr=value_lr)
