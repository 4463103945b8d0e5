"""PPO with a learned critic (mmpo.algos.ppo): the critic's values, GAE advantages and returns the module trains
on, the value loss reaching only the critic, the warm-up, 2 steps of configs/vlm/ppo_tiny.yaml and
configs/llm/ppo_tiny.yaml through `mmpo fit`, and an exact resume."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tiny_vlm_support import TEXT_TEST_TASKS, build_small_text_lm, tiny_grpo_fit_args

from mmpo.algos.ppo import PPOModule, ValueModelConfig
from mmpo.cli import main
from mmpo.core import token_gae
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import OptimConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


def _module(path: str, **critic) -> PPOModule:
    return PPOModule(path, sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                     optim=OptimConfig(lr=1e-3, micro_batch_size=2), critic=ValueModelConfig(lr=1e-2, **critic))


def test_advantages_are_token_gae_over_the_critics_values(text_path):
    module = _module(text_path, gamma=0.9, lam=0.8)
    with torch.no_grad():  # a non-zero head, so the values matter
        module.critic.head.bias.fill_(0.3)
        module.critic.head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("long_arithmetic", 2, seed=0))
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
    advantages, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    mask = rollout.completion_mask.float()
    with torch.no_grad():
        values = module.critic(rollout) * mask
    last = mask.sum(-1).long() - 1
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(4), last] = rewards
    expected, returns = token_gae(token_rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rollout.extras["ppo_returns"], returns * mask, atol=1e-6, rtol=0)
    assert metrics["critic/values_mean"] == pytest.approx(float(values.sum() / mask.sum()), abs=1e-6)


def test_the_value_loss_trains_only_the_critic_and_the_warmup_freezes_the_policy(text_path):
    module = _module(text_path, warmup_steps=1)
    policy_before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    critic_before = {n: p.detach().clone() for n, p in module.critic.named_parameters()}
    rows = make_items("long_arithmetic", 2, seed=0)
    # distinct rewards (the tiny model earns none): returns the critic can learn
    module.compute_rewards = lambda rollout: (torch.linspace(-1.0, 1.0, len(rollout)), {})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    # step 1 is the warm-up: the policy is unchanged; the critic's head moved, its backbone not yet (the head
    # starts at zero, so no gradient reaches the backbone through it on the first step)
    assert all(torch.equal(p, policy_before[n]) for n, p in module.model.named_parameters())
    moved = {n for n, p in module.critic.named_parameters() if not torch.equal(p, critic_before[n])}
    assert moved == {"head.weight", "head.bias"}
    assert module.last_metrics["critic/warmup"] == 1.0 and module._training_steps_done == 1
    assert math.isfinite(module.last_metrics["losses/value"]) and module.last_metrics["losses/value"] > 0
    # step 2: the warm-up is over; the policy and the critic's backbone move, its unused lm_head does not
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    assert module.last_metrics["critic/warmup"] == 0.0 and module._training_steps_done == 2
    assert any(not torch.equal(p, policy_before[n]) for n, p in module.model.named_parameters())
    moved = {n for n, p in module.critic.named_parameters() if not torch.equal(p, critic_before[n])}
    assert any(n.startswith("lm.model.") for n in moved) and not any("lm_head" in n for n in moved)


def _fit(config: str, model: str, tmp_path: Path, tasks: list[str], *extra: str) -> list[dict[str, str]]:
    # trainer.max_steps counts every optimizer step: the policy's and the critic's, 2 per update
    args = tiny_grpo_fit_args(CONFIGS / config, model, tmp_path, "--model.init_args.optim.micro_batch_size=2",
                              "--trainer.max_steps=4", *extra)
    args = [a if not a.startswith("--data.init_args.tasks=") else f"--data.init_args.tasks=[{','.join(tasks)}]"
            for a in args]
    assert main(args) == 0
    (path,) = tmp_path.glob("**/metrics.csv")
    return [row for row in csv.DictReader(path.open()) if row.get("losses/value")]


@pytest.mark.parametrize(("config", "kind"), [("vlm/ppo_tiny.yaml", "vlm"), ("llm/ppo_tiny.yaml", "text")])
def test_ppo_tiny_configs_train_two_steps(config, kind, tiny_path, text_path, tmp_path):
    model, tasks = (tiny_path, ["count_shapes", "arithmetic"]) if kind == "vlm" else (text_path, TEXT_TEST_TASKS)
    rows = _fit(config, model, tmp_path, tasks)
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row["losses/value"])) and math.isfinite(float(row["losses/policy"]))
        assert 0.0 <= float(row["critic/vf_clipfrac"]) <= 1.0
    # the value loss decreased as the critic learned the (same-batch-scale) returns is not guaranteed in 2 steps;
    # the checkpoint holds the critic (its own weights) and both optimizers
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert any(k.startswith("critic.head.") for k in checkpoint["state_dict"])
    assert len(checkpoint["optimizer_states"]) == 2 and int(checkpoint["state_dict"]["_ppo_steps"]) == 2


def test_ppo_resumes_exactly(text_path, tmp_path):
    """2 updates in one run == 1 update, then a resume from its checkpoint for the second (policy and critic)."""
    full = tmp_path / "full"
    _fit("llm/ppo_tiny.yaml", text_path, full, TEXT_TEST_TASKS)
    first = tmp_path / "first"
    _fit("llm/ppo_tiny.yaml", text_path, first, TEXT_TEST_TASKS, "--trainer.max_steps=2")
    resumed = tmp_path / "resumed"
    _fit("llm/ppo_tiny.yaml", text_path, resumed, TEXT_TEST_TASKS, f"--ckpt_path={first / 'ckpt' / 'last.ckpt'}")
    a = torch.load(full / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    b = torch.load(resumed / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)
