"""One metric vocabulary (docs/core.md, "Metric names"): a GRPO (VLM), an IGPO (dLLM) and a DPPO
(robotics) training step each log the shared keys, under the same names."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from golden_support import load_script
from torch.utils.data import DataLoader

from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig

TESTS = Path(__file__).resolve().parents[1]

# the keys every family's RL training step logs (docs/core.md)
SHARED = {"rewards/total/mean", "losses/policy", "losses/total", "policy/clipfrac", "policy/approx_kl", "perf/skipped_steps"}
RETIRED = {"rewards/mean", "train/frac_all_wrong"}  # the dLLM path's names before the shared vocabulary


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def test_grpo_step_logs_the_shared_keys(tmp_path):
    from mmpo.algos.grpo import GRPOModule
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import make_items
    from mmpo.rewards.registry import REWARDS
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3</think><answer>3</answer> 0123456789"] * 10
    path = build_tiny_vlm(tmp_path / "tiny", corpus=corpus, vocab_size=300, hidden_size=32, intermediate_size=64)
    scores = [1.0, 0.0, 0.0, 0.0]  # per completion, whatever the text: mean 0.25

    def scripted(completions, rows):
        return torch.tensor(scores[: len(completions)])

    REWARDS["vocabulary_scripted"] = scripted
    try:
        module = GRPOModule(str(path), sampling=SamplingConfig(num_generations=2, max_new_tokens=3),
                            loss=LossConfig(beta=0.0),
                            optim=OptimConfig(mu=2, minibatch_size=2),
                            rewards=RewardConfig(weights={"vocabulary_scripted": 1.0}, timeout_s=None))
        trainer = _trainer(max_steps=2)
        trainer.fit(module, DataLoader([make_items("count_shapes", 2, seed=0)], batch_size=None, collate_fn=lambda x: x))
    finally:
        del REWARDS["vocabulary_scripted"]
    logged = set(trainer.callback_metrics)
    assert SHARED <= logged, SHARED - logged
    assert float(trainer.callback_metrics["rewards/total/mean"]) == pytest.approx(0.25)


def test_igpo_step_logs_the_shared_keys(tmp_path):
    golden = load_script(TESTS / "dllm" / "golden" / "make_golden.py")
    metrics = golden.run("igpo_sequence", golden.build_model(tmp_path / "start"), tmp_path / "out")["metrics"]
    assert SHARED <= set(metrics), SHARED - set(metrics)
    assert not RETIRED & set(metrics)
    # scripted rollouts: 1 of 3 correct in group 0, and one correct hinted rollout replaces one in group 1
    assert metrics["rewards/total/mean"] == pytest.approx(2 / 6)


def test_dppo_step_logs_the_shared_keys(tmp_path):
    from mmpo.robotics.dppo import DPPOModule

    checkpoint = load_script(TESTS / "robotics" / "golden" / "make_golden.py").build_checkpoint(tmp_path)
    reach_envs = load_script(TESTS / "robotics" / "test_dppo.py").reach_envs
    torch.manual_seed(0)
    module = DPPOModule(str(checkpoint), num_iterations=1, env={"num_envs": 2, "n_steps": 3, "asynchronous": False},
                        chain={"ft_steps": 2}, optim={"minibatch_size": 4, "mu": 1}, evaluation={"every": 0},
                        critic={"warmup_iterations": 0, "hidden_dims": [16, 16]}, loss={"target_kl": None},
                        returns={"reward_scale_const": 2.0}, env_factory=reach_envs)
    rollouts = []
    collect = module.collect_rollout
    module.collect_rollout = lambda: rollouts.append(collect()) or rollouts[-1]
    trainer = _trainer(max_epochs=1)
    trainer.fit(module)
    logged = set(trainer.callback_metrics)
    assert SHARED <= logged, SHARED - logged
    # the rollout's per chunk step env rewards (x reward_scale_const), before running scaling
    expected = float(rollouts[0].rewards.double().mean())
    assert float(trainer.callback_metrics["rewards/total/mean"]) == pytest.approx(expected, rel=1e-6)
