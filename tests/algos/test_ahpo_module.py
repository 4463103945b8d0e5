"""AHPO as a module (MM-HELIX, arXiv 2510.08540): the gate on a real rollout, the loss equal to
the union-normalised hybrid loss, and an `mmpo fit` smoke run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("ahpo_model"), corpus=corpus)


def test_gate_and_update_equal_the_hand_computed_hybrid_loss(tiny_model, hand_grpo_advantages):
    """One real training step on a fixed rollout with SGD(lr=1): the weight change must be minus the
    gradient of Eq. 5 written out here, (sum_on -A_i log pi + sum_{gated y*} -log pi(y*)) / (N_on + |y*|),
    and the logged loss its value (ratio 1 on-policy, so the on-policy part is -sum A_i / Z)."""
    from mmpo.algos.ahpo import GATE, AHPOModule
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.logprobs import completion_log_probs
    from mmpo.vlm.processing import encode_completions, encode_prompts

    class FixedRolloutAHPO(AHPOModule):
        fixed = None  # (rollout, rewards)

        def build_rollout(self, rows):
            return self.fixed[0]

        def compute_rewards(self, rollout):
            return self.fixed[1].clone(), {}

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=1.0)

    module = FixedRolloutAHPO(str(tiny_model), optim=OptimConfig(max_grad_norm=0.0),
                              sampling={"num_generations": 3, "max_new_tokens": 4},
                              rewards=RewardConfig(timeout_s=None))
    rows = make_items("count_shapes", 3, seed=2)
    rows[2] = {**rows[2], "expert_trace": None}  # no trace: plain GRPO whatever its rewards
    torch.manual_seed(0)
    rollout = module.engine.generate(rows, num_samples=3, max_new_tokens=4)
    # prompt 0: 1 success < 2 -> gate on; prompt 1: 2 successes -> off; prompt 2: no trace -> off
    rewards = torch.tensor([1.0, 0.0, 0.1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    module.fixed = (rollout, rewards)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    assert rollout.extras[GATE].tolist() == [True] * 3 + [False] * 6
    metrics = module.last_metrics
    assert metrics["ahpo/gate_on_frac"] == pytest.approx(1 / 3)
    assert metrics["ahpo/prompts_with_trace_frac"] == pytest.approx(2 / 3)

    # by hand, on a fresh copy of the initial weights
    policy, processor = load_vlm(tiny_model)
    policy.train()
    mask = rollout.completion_mask.float()
    adv = hand_grpo_advantages(rewards, 3)[:, None].expand_as(mask)
    log_probs, _ = completion_log_probs(policy, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    prompts = encode_prompts(processor, rows[:1], system_prompt=module.engine.system_prompt)
    ids, expert_mask = encode_completions(processor, [rows[0]["expert_trace"]])
    expert_lp, _ = completion_log_probs(policy, prompts, ids, expert_mask)
    expert_mask = expert_mask.float()
    n_on, n_off = mask.sum(), expert_mask.sum()
    assert 0 < n_off and 0 < n_on
    expert_nll = -(expert_lp * expert_mask).sum()
    loss = (-(adv * log_probs * mask).sum() + expert_nll) / (n_on + n_off)
    loss.backward()
    for name, p in policy.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(before[name] - dict(module.model.named_parameters())[name].detach(), expected,
                                   atol=2e-6, rtol=1e-4, msg=name)
    value = (-(adv * mask).sum() + expert_nll.detach()) / (n_on + n_off)
    assert metrics["losses/total"] == pytest.approx(float(value), rel=1e-4, abs=1e-6)
    assert metrics["ahpo/off_policy_token_share"] == pytest.approx(float(n_off / (n_on + n_off)))
    assert metrics["ahpo/expert_nll"] == pytest.approx(float(expert_nll.detach() / n_off), rel=1e-4)


def test_ahpo_requires_token_mean(tiny_model):
    from mmpo.algos.ahpo import AHPOModule

    with pytest.raises(ValueError, match="token-mean"):
        AHPOModule(str(tiny_model), loss={"agg": "seq-mean-token-mean"})


def test_ahpo_fit_smoke_static(tiny_model, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("ahpo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.static=true",
                          "--model.init_args.sampling.num_generations=2")
    gate = [float(r["ahpo/gate_on_frac"]) for r in rows if r.get("ahpo/gate_on_frac")]
    logged = [r for r in rows if r.get("ahpo/off_policy_token_share")]
    assert gate == [1.0, 1.0]  # static: always on (every synthetic row has a trace)
    assert len(logged) == 2
    for r in logged:
        # share = expert tokens / (rollout tokens + expert tokens), rollout tokens = 2 prompts x G 2 x mean length:
        # the expert token count it implies is a whole number of tokens (>= 1 per gated prompt)
        share, on_tokens = float(r["ahpo/off_policy_token_share"]), 4 * float(r["response/length_mean"])
        off_tokens = share * on_tokens / (1.0 - share)
        assert off_tokens == pytest.approx(round(off_tokens), abs=1e-3) and round(off_tokens) >= 2
