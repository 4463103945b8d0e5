"""Multi-turn rollouts on a tiny Qwen3: holes exactly on the environment's tokens, log-probs equal to a
teacher-forced forward over the whole conversation, budgets respected, groups contiguous."""

from __future__ import annotations

import pytest
import torch
from agent_envs_support import ScriptedEnvironment
from tiny_vlm_support import build_small_text_lm

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask, observation_token_ids
from mmpo.vlm.rollout import HFGenerateEngine


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, processor = load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text")))
    # an lm_head with a bias towards the turn-end token, so that turns end after a few tokens
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = 6.0
    model.lm_head = biased
    return model, processor


def _segments(mask_row, attention_row):
    """[(trained?, start, end)] runs over the real tokens."""
    runs, start = [], 0
    length = int(attention_row.sum())
    for position in range(1, length + 1):
        if position == length or mask_row[position] != mask_row[start]:
            runs.append((bool(mask_row[start]), start, position))
            start = position
    return runs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_holes_are_exactly_the_environment_tokens_and_log_probs_match_a_forward(policy, temperature):
    model, processor = policy
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=200,
                             max_tokens_per_turn=24)
    rows = make_items("long_arithmetic", 2, seed=0)
    torch.manual_seed(0)
    rollout = engine.generate(rows, [ScriptedEnvironment() for _ in range(6)], num_samples=3,
                              temperature=temperature)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    attention = completion_attention_mask(rollout)
    eos = engine.engine.eos_token_id
    turns = rollout.extras["turns"].tolist()
    assert max(turns) == 3 and all(1 <= t <= 3 for t in turns)
    for i in range(6):
        runs = _segments(rollout.completion_mask[i], attention[i])
        model_runs = [r for r in runs if r[0]]
        holes = [r for r in runs if not r[0]]
        assert len(model_runs) == turns[i]
        assert len(holes) == turns[i] - 1
        assert rollout.extras["tool_calls"][i] == len(holes)
        for number, (_, start, end) in enumerate(holes, start=1):
            expected = observation_token_ids(processor, [{"role": "tool", "content": f"result {number}"}])
            assert rollout.completion_ids[i, start:end].tolist() == expected
            assert rollout.completion_ids[i, start - 1] == eos  # the model's turn ended just before
        # a trajectory that ran all three turns got the environment's final reward too
        if turns[i] == 3 and rollout.completion_ids[i, model_runs[-1][2] - 1] == eos:
            assert rollout.extras["env_rewards"][i] == pytest.approx(2.0)
    assert int(rollout.completion_mask.sum()) < int(attention.sum())  # there are holes
    log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention,
                                        temperature=temperature)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
    assert (rollout.extras["engine_log_probs"][~trained] == 0).all()
    # the texts reward functions see are the last model messages
    last = [processor.batch_decode([rollout.completion_ids[i, s:e].tolist()], skip_special_tokens=True)[0]
            for i, (_, s, e) in ((i, [r for r in _segments(rollout.completion_mask[i], attention[i]) if r[0]][-1])
                                 for i in range(6))]
    assert rollout.texts == last


def test_budgets_end_trajectories(policy):
    model, processor = policy
    torch.manual_seed(1)
    one_turn = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=1, max_total_tokens=200,
                               max_tokens_per_turn=24)
    rollout = one_turn.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment() for _ in range(4)],
                                num_samples=2)
    assert rollout.extras["turns"].tolist() == [1, 1, 1, 1]
    assert rollout.completion_mask.equal(completion_attention_mask(rollout))  # no environment tokens
    tight = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=5, max_total_tokens=30,
                            max_tokens_per_turn=24)
    rollout = tight.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment(10) for _ in range(4)],
                             num_samples=2)
    assert int(completion_attention_mask(rollout).sum(-1).max()) <= 30
    log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids,
                                        completion_attention_mask(rollout))
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
