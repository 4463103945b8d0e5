"""MAPO through the module path (arXiv 2509.18849): hand-computed groups, a shuffled batch,
the logged lambda / fallback metrics, and an `mmpo fit` smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmpo.data.synthetic import make_items
from mmpo.training.config import AdvantageConfig, LossConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("mapo_model"), corpus=corpus)


@pytest.fixture(scope="module")
def module(tiny_model):
    from mmpo.algos.mapo import MAPOModule

    return MAPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=4),
                      loss=LossConfig(beta=0.0))


GROUPS = [
    [1.0, 1.0, 1.0, 1.0],  # all correct: p = 1, lambda = 1, A = 0
    [0.0, 0.0, 0.0, 0.0],  # all wrong: p = 0, A = 0
    [1.0, 1.0, 0.0, 0.0],  # mixed: p = 0.5, lambda = 0 -> pure std form
    [1.0, 0.1, 0.1, 0.0],  # partial credit: p = 0.25, lambda = 0.25
    [0.1, 0.1, 0.0, 0.0],  # all fail, format credit only: p = 0, lambda = 1 -> pure APD
]
EPS = 1e-6  # in both denominators (paper)
SQRT_1_3 = math.sqrt(1 / 3)  # std of [1,1,0,0] (Bessel): sqrt(4 * 0.25 / 3)
SIGMA_3 = math.sqrt((0.7**2 + 0.2**2 + 0.2**2 + 0.3**2) / 3)  # sqrt(0.22) = 0.469042
EXPECTED = [
    [0.0] * 4,
    [0.0] * 4,
    [d / (SQRT_1_3 + EPS) for d in (0.5, 0.5, -0.5, -0.5)],  # +-0.866025
    # 0.75 * dev / sigma + 0.25 * dev / mu, mu = 0.3; r = 1: 0.75 * 1.492405 + 0.25 * 2.333333 = 1.702637
    [0.75 * d / (SIGMA_3 + EPS) + 0.25 * d / (0.3 + EPS) for d in (0.7, -0.2, -0.2, -0.3)],
    [d / (0.05 + EPS) for d in (0.05, 0.05, -0.05, -0.05)],  # (r - 0.05) / 0.05 = +-0.99998
]


def _batch():
    rewards = torch.tensor([r for g in GROUPS for r in g])
    ids = torch.arange(len(GROUPS)).repeat_interleave(4)
    return rewards, ids


def test_module_advantages_hand_computed_and_metrics(module):
    rewards, ids = _batch()
    adv, metrics = module.compute_advantages(rewards, ids, None)
    assert adv.tolist() == pytest.approx([a for g in EXPECTED for a in g], abs=1e-6)
    # lambda per group: [1, 1, 0, 0.25, 1]
    assert metrics["mapo/lambda_min"] == pytest.approx(0.0)
    assert metrics["mapo/lambda_max"] == pytest.approx(1.0)
    assert metrics["mapo/lambda_mean"] == pytest.approx((1 + 1 + 0 + 0.25 + 1) / 5)
    assert metrics["mapo/success_frac"] == pytest.approx((1 + 0 + 0.5 + 0.25 + 0) / 5)
    assert metrics["mapo/fallback_groups"] == 0.0


def test_shuffled_batch_permutes_advantages(module):
    rewards, ids = _batch()
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(3))
    adv, _ = module.compute_advantages(rewards, ids, None)
    adv_shuffled, _ = module.compute_advantages(rewards[perm], ids[perm] * 7 + 100, None)  # ids need not be 0..P-1
    assert torch.allclose(adv_shuffled, adv[perm], atol=1e-6)


def test_fallback_counted_when_mean_not_positive(module):
    # mean 0 with spread (a shaped negative reward): APD undefined -> std form, counted
    rewards = torch.tensor([-0.1, 0.1, 0.1, -0.1])
    adv, metrics = module.compute_advantages(rewards, torch.zeros(4, dtype=torch.long), None)
    sigma = math.sqrt(4 * 0.01 / 3)  # 0.115470
    assert adv.tolist() == pytest.approx([d / (sigma + EPS) for d in (-0.1, 0.1, 0.1, -0.1)], abs=1e-5)
    assert metrics["mapo/fallback_groups"] == 1.0


def test_rejects_non_mapo_estimator(tiny_model):
    from mmpo.algos.mapo import MAPOModule

    with pytest.raises(ValueError, match="mapo"):
        MAPOModule(str(tiny_model), advantage={"name": "grpo"})


def test_mapo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    # G = 4 and rewards [1, 0, 0, 0] per prompt: p = 1/4, lambda = 1 - 4 * 1/4 * 3/4 = 1/4 in every group
    weights = scripted_reward([1.0, 0.0, 0.0, 0.0])
    rows = fit_vlm_config("mapo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=4",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("mapo/lambda_mean")]
    assert len(logged) == 2
    for row in logged:
        for key in ("mapo/lambda_mean", "mapo/lambda_min", "mapo/lambda_max", "mapo/success_frac",
                    "rewards/total/mean"):
            assert float(row[key]) == pytest.approx(0.25), key
        assert float(row["mapo/fallback_groups"]) == 0.0
