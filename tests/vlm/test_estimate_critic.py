"""`mmpo estimate` counts PPO's value model: its weights, and when trained its gradients, AdamW states and a second
forward / backward of activations; DVPO's frozen one only its weights; the KL in the reward keeps a reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpo.vlm.estimate_cli import estimate_config
from mmpo.vlm.memory import architecture_dims

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "grpo_qwen2_5_vl_7b.yaml"
PPO = ["model.class_path=mmpo.algos.ppo.PPOModule", "model.init_args.advantage=null", "model.init_args.loss.beta=0"]


def test_estimate_counts_the_value_model():
    dims = architecture_dims("qwen2.5-vl-7b")
    grpo, _ = estimate_config(CONFIG, architecture="qwen2.5-vl-7b", overrides=["model.init_args.loss.beta=0"])
    ppo, table = estimate_config(CONFIG, architecture="qwen2.5-vl-7b", overrides=PPO)
    # the config's float32 weights sharded over 8 GPUs: weights + gradients + 2 AdamW states of a second model
    assert ppo["critic"] == pytest.approx(4 * dims.num_params * 4 / 8)
    assert grpo["critic"] == 0 and ppo["reference"] == 0 == grpo["reference"]
    assert ppo["steady"] == pytest.approx(grpo["steady"] + ppo["critic"])
    assert ppo["activations"] == pytest.approx(2 * grpo["activations"])
    assert "value model (trained)" in table
    frozen, table = estimate_config(CONFIG, architecture="qwen2.5-vl-7b",
                                    overrides=[*PPO, "model.init_args.critic.frozen=true"])
    assert frozen["critic"] == pytest.approx(dims.num_params * 4 / 8)
    assert frozen["activations"] == pytest.approx(grpo["activations"])
    assert "value model (frozen)" in table
    # KL in the reward: the frozen reference copy, as GRPO's beta > 0 keeps
    with_kl, _ = estimate_config(CONFIG, architecture="qwen2.5-vl-7b", overrides=[*PPO, "model.init_args.kl_coef=0.001"])
    assert with_kl["reference"] > 0


def test_estimate_counts_t_ppos_value_model_and_not_its_head():
    tppo = ["model.class_path=mmpo.algos.tppo.TPPOModule", "model.init_args.advantage=null",
            "model.init_args.loss.beta=0", "model.init_args.optim.minibatch_size=null"]
    dims = architecture_dims("qwen2.5-vl-7b")
    with_model, table = estimate_config(CONFIG, architecture="qwen2.5-vl-7b", overrides=tppo)
    head_only, _ = estimate_config(CONFIG, architecture="qwen2.5-vl-7b", overrides=[*tppo, "model.init_args.critic=null"])
    # T-PPO's default critic is PPO's trained value model: weights + gradients + 2 AdamW states over 8 GPUs
    assert with_model["critic"] == pytest.approx(4 * dims.num_params * 4 / 8)
    assert "value model (trained)" in table
    assert head_only["critic"] == 0  # the head on the policy's states: one linear layer, not counted
