"""TreePO through the module path: the fork budget by hand, the tree sampler's structure on a tiny
model (EOS and vision tokens suppressed, so every path runs to full length and the tree shape is
known), and an `mmpo fit` smoke run of configs/vlm/variants/treepo_tiny.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmpo.algos.treepo import fork_counts, grow_trees
from mmpo.data.synthetic import make_items
from mmpo.training.config import AdvantageConfig, LossConfig, SamplingConfig


def test_fork_counts_by_hand():
    # width 4, branching 2: 2 active, none finished -> budget min(4, 4) = 4 -> [2, 2]
    assert fork_counts(2, 0, 0, width=4, branching=2) == [2, 2]
    # 4 active -> budget min(4, 8) = 4 -> one child each
    assert fork_counts(4, 0, 0, width=4, branching=2) == [1, 1, 1, 1]
    # width 5: 4 active -> budget min(5, 8) = 5 -> the remainder goes to the first path
    assert fork_counts(4, 0, 0, width=5, branching=2) == [2, 1, 1, 1]
    # width 8, 1 finished this step, 1 active: budget min(8 - 1, 2 + 2) = 4 -> the finished path's forks move over
    assert fork_counts(1, 1, 1, width=8, branching=2) == [4]
    # the width is spent: still one child per active path
    assert fork_counts(3, 6, 0, width=8, branching=2) == [1, 1, 1]
    assert fork_counts(0, 2, 0, width=8, branching=2) == []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("treepo_model"), corpus=corpus)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.rollout import HFGenerateEngine

    model, processor = load_vlm(str(tiny_model))
    engine = HFGenerateEngine(model, processor)
    # no path may end early: the tree's shape is then fixed by the budget rule alone
    model.generation_config.suppress_tokens = [engine.eos_token_id, *engine.forbidden_ids]
    return engine


@pytest.mark.parametrize("width, expected", [
    (4, [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]),               # 2 -> 4 -> 4 paths
    (5, [[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [1, 1, 0]]),    # 2 -> 4 -> 5: the first path forks twice
])
def test_tree_shape_and_shared_prefixes(engine, width, expected):
    rows = make_items("count_shapes", 2, seed=1)
    torch.manual_seed(0)
    # segments of 3 tokens, budget 8 -> depth 3 (3 + 3 + 2 tokens)
    rollout = grow_trees(engine, rows, width=width, segment_len=3, max_new_tokens=8)
    assert rollout.group_ids.tolist() == [0] * width + [1] * width
    for g in range(2):
        assert rollout.extras["tree_path_ids"][g * width:(g + 1) * width].tolist() == expected
    assert rollout.completion_mask.sum(-1).tolist() == [8] * (2 * width)
    assert rollout.extras["tree_depth"].tolist() == [3] * (2 * width)
    ids, paths = rollout.completion_ids, rollout.extras["tree_path_ids"]
    for i in range(len(rollout)):
        for j in range(len(rollout)):
            if rollout.group_ids[i] != rollout.group_ids[j]:
                continue
            # leaves agreeing on the first d choices share the first 3 d tokens (the same tree nodes)
            for d in (1, 2):
                if paths[i, :d].tolist() == paths[j, :d].tolist():
                    assert ids[i, : 3 * d].tolist() == ids[j, : 3 * d].tolist()


def test_treepo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0, 0.0])
    rows = fit_vlm_config("variants/treepo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.segment_len=2",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}")
    logged = [r for r in rows if r.get("treepo/leaves_per_prompt")]
    assert len(logged) == 2
    for row in logged:
        assert 2 <= float(row["treepo/leaves_per_prompt"]) <= 8  # first_branching .. num_generations
        assert 1 <= float(row["treepo/depth_mean"]) <= 3  # max_new_tokens 6 / segment_len 2
        assert float(row["advantages/tree_levels_mean"]) >= 1.0


def test_filtered_prompts_leave_the_whitening(tiny_model):
    from mmpo.algos.treepo import TreePOModule
    from mmpo.vlm.rollout import Rollout

    module = TreePOModule(str(tiny_model), sampling=SamplingConfig(num_generations=4),
                          loss=LossConfig(beta=0.0),
                          advantage={"dynamic_sampling": True})
    # prompt 0: leaves [0,0], [0,1], [1,0], [1,1] with rewards 1, 0, 1, 1 (tests/core/test_advantages_tree.py:
    # averages .375, -.625, .125, .125, sample var .1875); prompt 1: all 1 -> dropped by the zero-std filter,
    # so its four zero scores do not enter the whitening statistics
    paths = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]).repeat(2, 1)
    rollout = Rollout(rows=[{}] * 8, group_ids=torch.tensor([0] * 4 + [1] * 4), prompt_inputs=None,
                      completion_ids=torch.zeros(8, 1, dtype=torch.long), completion_mask=torch.ones(8, 1, dtype=torch.long),
                      texts=[""] * 8, extras={"tree_path_ids": paths, "tree_depth": torch.full((8,), 2)})
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    expected = torch.tensor([0.375, -0.625, 0.125, 0.125]) / (0.1875 + 1e-8) ** 0.5
    torch.testing.assert_close(adv[:4, 0], expected)
    assert adv[4:].abs().sum() == 0
    assert metrics["treepo/leaves_per_prompt"] == 4.0
