"""AHPO as a module (MM-HELIX, arXiv 2510.08540): the gate on a real rollout, the loss equal to
the union-normalised hybrid loss, and an `mmpo fit` smoke run."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from mmpo.core import aggregate, policy_loss
from mmpo.data.synthetic import make_items


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("ahpo_model"), corpus=corpus)


def test_gate_and_loss_equal_the_hybrid_loss(tiny_model):
    from mmpo.algos.ahpo import GATE, AHPOModule, hybrid_loss
    from mmpo.vlm.logprobs import completion_log_probs
    from mmpo.vlm.processing import encode_completions, encode_prompts

    module = AHPOModule(str(tiny_model), num_generations=3, max_new_tokens=4, reward_timeout_s=None)
    rows = make_items("count_shapes", 3, seed=2)
    rows[2] = {**rows[2], "expert_trace": None}  # no trace: plain GRPO whatever its rewards
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    # prompt 0: 1 success < 2 -> gate on; prompt 1: 2 successes -> off; prompt 2: no trace -> off
    rewards = torch.tensor([1.0, 0.0, 0.1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    advantages, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    assert rollout.extras[GATE].tolist() == [True] * 3 + [False] * 6
    assert metrics["ahpo/gate_on_frac"] == pytest.approx(1 / 3)
    assert metrics["ahpo/prompts_with_trace_frac"] == pytest.approx(2 / 3)

    # the trainer's micro-batch loss (whole rollout, on-policy) + AHPO's extra term ...
    log_probs, _ = module.sequence_log_probs(module.model, rollout)
    mask = rollout.completion_mask.float()
    n_on = mask.sum()
    agg = partial(aggregate, mode="token-mean", global_tokens=n_on, global_seqs=torch.tensor(9.0))
    pg, _ = policy_loss("ppo", log_probs, log_probs.detach(), advantages, mask, agg="token-mean", global_tokens=n_on)
    outputs = {"log_probs": log_probs, "old_log_probs": log_probs.detach(), "advantages": advantages,
               "mask": mask, "aggregate": agg}
    extra, extra_metrics = module.extra_loss_terms(rollout, outputs)
    total = pg + extra
    # ... equals (sum_on -A_i + sum_expert -log pi(y*)) / (N_on + |y*|) (ratio 1 on-policy)
    prompts = encode_prompts(module.processor, rows[:1])
    ids, expert_mask = encode_completions(module.processor, [rows[0]["expert_trace"]])
    expert_lp, _ = completion_log_probs(module.model, prompts, ids, expert_mask)
    per_token_on = -advantages[:, None].expand_as(mask)
    expected, expected_metrics = hybrid_loss(per_token_on, mask, expert_lp, expert_mask, torch.tensor([True]))
    assert float(total.detach()) == pytest.approx(float(expected.detach()), rel=1e-4)
    assert metrics["ahpo/off_policy_token_share"] == pytest.approx(expected_metrics["ahpo/off_policy_token_share"])
    assert extra_metrics["ahpo/expert_nll"] == pytest.approx(expected_metrics["ahpo/expert_nll"], rel=1e-4)


def test_ahpo_requires_token_mean(tiny_model):
    from mmpo.algos.ahpo import AHPOModule

    with pytest.raises(ValueError, match="token-mean"):
        AHPOModule(str(tiny_model), agg="seq-mean-token-mean")


def test_ahpo_fit_smoke_static(tiny_model, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("ahpo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.static=true",
                          "--model.init_args.num_generations=2")
    gate = [float(r["ahpo/gate_on_frac"]) for r in rows if r.get("ahpo/gate_on_frac")]
    share = [float(r["ahpo/off_policy_token_share"]) for r in rows if r.get("ahpo/off_policy_token_share")]
    assert gate == [1.0, 1.0]  # static: always on (every synthetic row has a trace)
    assert all(0.0 < s < 1.0 for s in share)
