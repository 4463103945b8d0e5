"""Segment-PO through the module path: Monte Carlo values at the cut points (a scripted reward makes
every value known), the probability mask as the loss mask, and an `mmpo fit` smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmpo.algos.grpo import loss_mask
from mmpo.core import compute_advantages
from mmpo.core.advantages_tree import segment_cut_points, segment_probability_mask
from mmpo.data.synthetic import make_items
from mmpo.training.config import AdvantageConfig, LossConfig, RewardConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("segment_model"), corpus=corpus)


def test_mc_values_at_cut_points(tiny_model, scripted_reward):
    from mmpo.algos.segment import SegmentPOModule

    # 3 continuations per cut point, one cut point per generate call: the scripted reward gives each call's
    # continuations [1, 0, 0], so every Monte Carlo value is (1 + 0 + 0) / 3
    weights = scripted_reward([1.0, 0.0, 0.0])
    module = SegmentPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2, max_new_tokens=8),
                             loss=LossConfig(beta=0.0), cutpoint_interval=2,
                             mc_samples=3, mc_batch_size=3, rewards=RewardConfig(weights=weights))
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("count_shapes", 2, seed=3))
    log_probs, mask = rollout.extras["segment_log_probs"], rollout.completion_mask
    cuts = segment_cut_points(log_probs, mask, interval=2)
    values, query = rollout.extras["segment_values"], rollout.extras["segment_query_values"]
    for i, row_cuts in enumerate(cuts):
        expected = torch.full((mask.shape[1],), math.nan)
        for c in row_cuts:
            if c >= 0:
                expected[c] = 1 / 3
        torch.testing.assert_close(values[i], expected, equal_nan=True)
        assert (query[i].item() == pytest.approx(1 / 3)) if -1 in row_cuts else math.isnan(query[i].item())
    assert sum(len(c) for c in cuts) > 0  # the tiny model is uncertain: there are cut points
    assert torch.equal(rollout.extras["loss_mask"], segment_probability_mask(log_probs, mask).long())
    assert torch.equal(loss_mask(rollout), rollout.extras["loss_mask"])

    # the module's advantages are the core estimator's on these values
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    state = torch.cat([query.unsqueeze(1), values], 1)
    torch.testing.assert_close(adv, compute_advantages("segment", rewards, rollout.group_ids, mask=mask.float(),
                                                       old_log_probs=log_probs, state_values=state))
    assert metrics["segment/cut_points_mean"] == pytest.approx(sum(len(c) for c in cuts) / 4)


def test_rejects_other_estimators(tiny_model):
    from mmpo.algos.segment import SegmentPOModule

    with pytest.raises(ValueError, match="segment"):
        SegmentPOModule(str(tiny_model), advantage={"name": "grpo"})
    with pytest.raises(ValueError, match="mc_samples"):
        SegmentPOModule(str(tiny_model), mc_samples=0)


def test_segment_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0])
    rows = fit_vlm_config("variants/segment_tiny.yaml", tiny_model, tmp_path, "--model.init_args.mc_samples=2",
                          "--model.init_args.sampling.num_generations=2", f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("segment/cut_points_mean")]
    assert len(logged) == 2
    for row in logged:
        assert 0.0 <= float(row["advantages/prob_masked_frac"]) <= 1.0
        assert math.isfinite(float(row["losses/policy"]))
