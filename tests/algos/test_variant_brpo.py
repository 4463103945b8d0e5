"""BRPO through the module path: a budgeted rollout on a tiny model (EOS suppressed, so every trace
runs its full budget and gets summaries at both budgets), scripted scores, and the advantages worked
out by hand; plus an `mmpo fit` smoke run of configs/vlm/variants/brpo_tiny.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, RewardConfig, RolloutCorrectionConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("brpo_model"), corpus=corpus)


def test_budgeted_rollout_rewards_and_advantages_by_hand(tiny_model, scripted_reward):
    from mmpo.algos.brpo import BRPOModule

    # rollout order: traces t0, t1, then 2 summaries each of (t0, b1), (t0, b2), (t1, b1), (t1, b2)
    weights = scripted_reward([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    module = BRPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2, max_new_tokens=4), num_budgets=2,
                        num_summaries=2, summary_max_tokens=2,
                        loss=LossConfig(beta=0.0),
                        rewards=RewardConfig(weights=weights))
    module.model.generation_config.suppress_tokens = [module.engine.eos_token_id, *module.engine.forbidden_ids]
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("count_shapes", 1, seed=2))
    assert len(rollout) == 10
    assert rollout.extras["brpo_kind"].tolist() == [0, 0] + [1] * 8
    assert rollout.extras["brpo_response"].tolist() == [0, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert rollout.extras["brpo_budget"].tolist() == [-1, -1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert rollout.group_ids.tolist() == [0] * 10
    # a summary's prompt ends with the trace cut at its budget (2 or 4 tokens) and the cue
    cue = module._cue_ids.tolist()
    for k, (g, b) in enumerate([(0, 2), (0, 4), (1, 2), (1, 4)]):
        prompt = rollout.prompt_inputs["input_ids"][2 + 2 * k]
        assert prompt[-(b + len(cue)):].tolist() == rollout.completion_ids[g, :b].tolist() + cue

    rewards, metrics = module.compute_rewards(rollout)
    # budget scores: t0 [mean(1, 0), mean(1, 1)] = [.5, 1]; t1 [0, .5]; uniform prior -> objectives .75, .25
    torch.testing.assert_close(rollout.extras["brpo_budget_scores"][:2], torch.tensor([[0.5, 1.0], [0.0, 0.5]]))
    assert rewards.tolist() == pytest.approx([0.75, 0.25, 1, 0, 1, 1, 0, 0, 1, 0])
    assert metrics["brpo/objective_mean"] == pytest.approx(0.5)

    adv, _ = module.compute_advantages(rewards, rollout.group_ids, rollout)
    # segment 0 (tokens 0, 1): R = [.75, .25], V2 = .5 -> [.25, -.25]
    # segment 1 (tokens 2, 3): R = [.5, .25], V2 = .375, V1 = r_1 * p_2 = [.25, 0],
    #   baseline (V1 + V2)/2 = [.3125, .1875] -> [.1875, .0625]
    torch.testing.assert_close(adv[:2, :4], torch.tensor([[0.25, 0.25, 0.1875, 0.1875], [-0.25, -0.25, 0.0625, 0.0625]]))
    # summaries: score - mean of the pair: (t0,b1) [1, 0] -> +-.5; (t0,b2) [1, 1] -> 0; (t1,b1) 0; (t1,b2) [1, 0] -> +-.5
    expected = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5]
    torch.testing.assert_close(adv[2:, :2], torch.tensor(expected).unsqueeze(1).expand(8, 2))


def test_rejects_budgets_that_do_not_divide_the_length(tiny_model):
    from mmpo.algos.brpo import BRPOModule

    with pytest.raises(ValueError, match="must divide max_new_tokens"):
        BRPOModule(str(tiny_model), sampling=SamplingConfig(max_new_tokens=10), num_budgets=4)


def test_brpo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0, 0.0])
    rows = fit_vlm_config("variants/brpo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.num_budgets=2",
                          "--model.init_args.summary_max_tokens=3", f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("brpo/objective_mean")]
    assert len(logged) == 2
    for row in logged:
        assert 0.0 <= float(row["brpo/objective_mean"]) <= 1.0


@pytest.mark.parametrize("module_path", ["mmpo.algos.brpo.BRPOModule", "mmpo.algos.treepo.TreePOModule",
                                         "mmpo.algos.tppo.TPPOModule"])
def test_structured_rollouts_refuse_rollout_is(tiny_model, module_path):
    import importlib

    module_name, class_name = module_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    extra = {"BRPOModule": {"num_budgets": 2}, "TPPOModule": {"window_len": 2}}.get(class_name, {})
    with pytest.raises(ValueError, match="rollout_is null"):
        cls(str(tiny_model), sampling=SamplingConfig(num_generations=2, max_new_tokens=4),
            rollout_correction=RolloutCorrectionConfig(mode="token_truncate"), **extra)
