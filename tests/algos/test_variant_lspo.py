"""LSPO through the module path (arXiv 2510.01459): the length bands after the zero-variance filter,
and a 2-step `mmpo fit` of configs/vlm/variants/lspo_tiny.yaml."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mmpo.training.config import AdvantageConfig, LossConfig, SamplingConfig


CONFIG = "variants/lspo_tiny.yaml"



def _rollout(lengths: list[int], group_size: int) -> SimpleNamespace:
    """What filter_groups reads: completion masks of the given lengths and contiguous group ids."""
    width = max(lengths)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return SimpleNamespace(completion_mask=mask, group_ids=torch.arange(len(lengths) // group_size).repeat_interleave(group_size))


def test_filter_after_zero_variance_hand_computed(tiny_model):
    from mmpo.algos.lspo import LSPOModule

    module = LSPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.0))
    # 5 prompts x 2: mean lengths 3, 10, 6, 22, 8; prompt 1's rewards agree -> zero-variance filter drops it
    rollout = _rollout([2, 4, 10, 10, 5, 7, 20, 24, 8, 8], 2)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    keep, metrics = module.filter_groups(rewards, rollout)
    # remaining L = [3, 6, 8, 22]: Q(0.3) = 5.7, Q(0.65) = 7.9, Q(0.95) = 19.9 (tests/core/test_lspo_filter.py)
    # -> keep prompt 0 (3) and prompt 4 (8); prompt 2 (6, middle band) and prompt 3 (22, above Q(0.95)) go
    assert keep.tolist() == [True, True, False, False, False, False, False, False, True, True]
    assert metrics["rewards/dropped_groups"] == 1
    assert metrics["lspo/dropped_groups"] == 2.0
    assert metrics["lspo/kept_frac"] == pytest.approx(2 / 5)


def test_without_zero_variance_filter_and_bad_bands(tiny_model):
    from mmpo.algos.lspo import LSPOModule

    module = LSPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.0),
                        advantage={"dynamic_sampling": False},
                        lspo_max=1.0)
    rollout = _rollout([2, 4, 10, 10, 5, 7, 20, 24, 8, 8], 2)
    keep, metrics = module.filter_groups(torch.zeros(10), rollout)
    # all 5 prompts in play: Q(0.3) = 6.4, Q(0.65) = 9.2, Q(1) = 22 -> only prompt 4 (L = 8) goes
    assert keep.tolist() == [True] * 8 + [False, False]
    assert "rewards/dropped_groups" not in metrics
    with pytest.raises(ValueError, match="lspo_low <= lspo_high"):
        LSPOModule(str(tiny_model), lspo_low=0.8, lspo_high=0.5)


def test_lspo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0])  # every group varies: the zero-variance filter drops none
    rows = fit_vlm_config(CONFIG, tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("lspo/kept_frac")]
    assert len(logged) == 2
    for row in logged:
        assert float(row["rewards/dropped_groups"]) == 0.0
        # 4 prompts: the bands keep between 1 and 4 of them (at least the shortest, at most all)
        assert 0.25 <= float(row["lspo/kept_frac"]) <= 1.0
        assert float(row["lspo/dropped_groups"]) == pytest.approx(4 * (1 - float(row["lspo/kept_frac"])))
