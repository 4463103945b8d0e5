"""AHPO's gate and union-normalised loss (MM-HELIX, arXiv 2510.08540), hand-computed."""

from __future__ import annotations

import pytest
import torch

from mmpo.algos.ahpo import expert_gate, hybrid_loss

# 3 prompts x G = 5 rollouts, deliberately interleaved (gates are keyed by id, not position).
REWARDS_BY_PROMPT = {
    7: [1.0, 0.0, 0.0, 0.1, 0.0],  # 1 success < R_hat = 2 -> gate on (has a trace)
    3: [1.0, 1.0, 0.0, 0.0, 0.9999],  # 2 successes -> gate off (0.9999 is not a success)
    5: [0.0, 0.0, 0.0, 0.0, 0.0],  # 0 successes but no trace -> plain GRPO, gate off
}
HAS_TRACE = {7: True, 3: True, 5: False}


def _batch():
    ids, rewards, trace = [], [], []
    for k in range(5):
        for pid in (7, 3, 5):
            ids.append(pid)
            rewards.append(REWARDS_BY_PROMPT[pid][k])
            trace.append(HAS_TRACE[pid])
    return torch.tensor(rewards), torch.tensor(ids), torch.tensor(trace)


def test_gate_counts_exact_successes_per_prompt():
    rewards, ids, trace = _batch()
    prompt_ids, gate = expert_gate(rewards, ids, trace, min_successes=2)
    assert prompt_ids.tolist() == [3, 5, 7]
    assert gate.tolist() == [False, False, True]


def test_gate_threshold_and_static_variant():
    rewards, ids, trace = _batch()
    # R_hat = 3: prompt 3 (2 successes) now also opens
    assert expert_gate(rewards, ids, trace, min_successes=3)[1].tolist() == [True, False, True]
    # Static-AHPO: always on where a trace exists
    assert expert_gate(rewards, ids, trace, static=True)[1].tolist() == [True, False, True]
    # all-correct prompt with a trace stays closed
    r = torch.ones(5)
    assert expert_gate(r, torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool))[1].tolist() == [False]


ON_LOSS = torch.tensor([[0.5, -0.2, 0.1], [0.3, 9.0, 9.0]])
ON_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
EXPERT_LP = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
EXPERT_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_hybrid_loss_normalises_over_union_of_tokens():
    lp = EXPERT_LP.clone().requires_grad_(True)
    loss, metrics = hybrid_loss(ON_LOSS, ON_MASK, lp, EXPERT_MASK, torch.tensor([True, False]))
    # on-policy: 0.5 - 0.2 + 0.1 + 0.3 = 0.7 over 4 tokens; gated expert (trace 0): 1 + 2 = 3 over 2 tokens
    # L = (0.7 + 3.0) / (4 + 2) = 0.616667
    assert float(loss.detach()) == pytest.approx(3.7 / 6)
    assert metrics["ahpo/off_policy_token_share"] == pytest.approx(2 / 6)
    assert metrics["ahpo/expert_nll"] == pytest.approx(1.5)
    loss.backward()
    # d L / d log pi(y*_t) = -1 / Z for gated real tokens, 0 elsewhere
    assert torch.allclose(lp.grad, torch.tensor([[-1 / 6, -1 / 6], [0.0, 0.0]]))


def test_hybrid_loss_gate_off_is_plain_token_mean():
    loss, metrics = hybrid_loss(ON_LOSS, ON_MASK, EXPERT_LP, EXPERT_MASK, torch.tensor([False, False]))
    assert float(loss) == pytest.approx(0.7 / 4)
    assert metrics["ahpo/off_policy_token_share"] == 0.0


def test_hybrid_loss_micro_batches_sum_to_full_batch():
    gate = torch.tensor([True, True])
    full, _ = hybrid_loss(ON_LOSS, ON_MASK, EXPERT_LP, EXPERT_MASK, gate)
    # Z = 4 on + 3 expert = 7; (0.7 + 1 + 2 + 3) / 7
    assert float(full) == pytest.approx(6.7 / 7)
    part_a, _ = hybrid_loss(ON_LOSS[:1], ON_MASK[:1], EXPERT_LP[:1], EXPERT_MASK[:1], gate[:1], total_tokens=7)
    part_b, _ = hybrid_loss(ON_LOSS[1:], ON_MASK[1:], EXPERT_LP[1:], EXPERT_MASK[1:], gate[1:], total_tokens=7)
    assert float(part_a + part_b) == pytest.approx(float(full))
