"""Dr.GRPO's normaliser is the constant max_new_tokens (TRL ``loss_type="dr_grpo"``), never the padded width.

TRL 1.x ``GRPOTrainer._compute_loss`` for ``dr_grpo``::

    per_token_loss = -min(ratio * A, clip(ratio) * A) + beta * per_token_kl
    loss = (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * self.max_completion_length)

Our ``agg="seq-mean-token-sum-norm"`` must give that loss and its gradient on a batch whose
longest completion (5 tokens) is shorter than ``max_new_tokens`` (8): dividing by the step's
padded width instead (the old behaviour) is 8/5 too large. The KL and the entropy bonus share
the normaliser.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.algos.grpo import GRPOModule
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, RewardConfig, SamplingConfig, merged_settings
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

MAX_NEW_TOKENS = 8  # TRL's max_completion_length
WIDTH = 5  # the longest completion of the test batch
BETA, ENTROPY_COEF = 0.3, 0.05
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])  # two groups of G = 3


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> 0123456789"] * 10
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=corpus, vocab_size=300, hidden_size=32,
                              intermediate_size=64))


class FixedDrGRPO(GRPOModule):
    """Dr.GRPO on a given rollout, with SGD(lr=1): one step moves the weights by minus the gradient."""

    fixed_rollout = None

    def build_rollout(self, rows):
        return self.fixed_rollout

    def compute_rewards(self, rollout):
        return REWARDS.clone(), {}

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1.0)


def _module(path: str, **settings) -> FixedDrGRPO:
    module = FixedDrGRPO(path, **merged_settings(dict(
        sampling=SamplingConfig(num_generations=3, max_new_tokens=MAX_NEW_TOKENS), advantage=AdvantageConfig(name="drgrpo"),
        loss=LossConfig(agg="seq-mean-token-sum-norm", beta=BETA, entropy_coef=ENTROPY_COEF),
        optim=OptimConfig(max_grad_norm=0.0), rewards=RewardConfig(timeout_s=None)), settings))
    # a reference that differs from the policy, so the KL term and its gradient are not zero
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.reference_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return module


@pytest.fixture(scope="module")
def batch(tiny_path):
    rows = make_items("count_shapes", 2, seed=0)
    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                        loss=LossConfig(beta=0.0))
    torch.manual_seed(0)
    rollout = HFGenerateEngine(module.model, module.processor).generate(rows, num_samples=3, max_new_tokens=WIDTH)
    # completion lengths 1..5 (as if EOS came early); padded width 5 < max_new_tokens 8
    lengths = torch.tensor([1, 2, 3, 4, 5, 5])
    keep = torch.arange(rollout.completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    rollout.completion_mask = rollout.completion_mask * keep
    rollout.completion_ids = rollout.completion_ids.masked_fill(~keep, module.processor.tokenizer.pad_token_id)
    assert rollout.completion_ids.shape[1] == WIDTH
    return rows, rollout


def _trl_dr_grpo(path: str, rollout) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's dr_grpo loss (+ our entropy bonus, same normaliser) and its gradient, by hand."""
    module = _module(path)
    policy, reference = module.model, module.reference_model
    policy.train()
    inputs = (rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    log_probs, entropy = completion_log_probs(policy, *inputs, with_entropy=True)
    with torch.no_grad():
        ref_log_probs, _ = completion_log_probs(reference, *inputs)
    # Dr.GRPO advantages: r - group mean (no std): (0.5, -0.5, 0) and (-2/3, 1/3, 1/3)
    advantages = torch.tensor([0.5, -0.5, 0.0, -2 / 3, 1 / 3, 1 / 3]).unsqueeze(1)
    ratio = torch.exp(log_probs - log_probs.detach())  # on-policy: 1, with the policy gradient
    per_token_kl = torch.exp(ref_log_probs - log_probs) - (ref_log_probs - log_probs) - 1
    per_token_loss = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) + BETA * per_token_kl
    per_token_loss = per_token_loss - ENTROPY_COEF * entropy
    mask = rollout.completion_mask.float()
    loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_NEW_TOKENS)
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in policy.named_parameters()}
    return float(loss.detach()), grads


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_drgrpo_loss_and_gradient_match_trl_dr_grpo(tiny_path, batch, micro_batch_size):
    rows, rollout = batch
    expected_loss, expected_grads = _trl_dr_grpo(tiny_path, rollout)

    module = _module(tiny_path, optim={"micro_batch_size": micro_batch_size})
    module.fixed_rollout = rollout
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))

    assert module.last_metrics["losses/total"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    assert module.last_metrics["losses/kl"] > 0  # the KL term is really exercised
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def test_norm_len_overrides_max_new_tokens_and_is_validated(tiny_path, batch):
    rows, rollout = batch
    module = _module(tiny_path, loss={"norm_len": 16})
    module.fixed_rollout = rollout
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    expected_loss, _ = _trl_dr_grpo(tiny_path, rollout)
    assert module.last_metrics["losses/total"] == pytest.approx(expected_loss * MAX_NEW_TOKENS / 16, rel=1e-5)
    with pytest.raises(ValueError, match="norm_len must be >= 1"):
        GRPOModule(tiny_path, loss=LossConfig(norm_len=0))
