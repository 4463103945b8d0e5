"""LoRA on a text-only LM (issue 38): adapter-only gradients, the KL reference is the adapter-disabled
policy (equal to the base model's log-probs), the export is merged weights plus the adapter; SFT and DPO
with an adapter; freeze_vision_tower is refused for a model without one."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from tiny_vlm_support import build_small_text_lm
from torch.utils.data import DataLoader

from mmpo.algos.grpo import GRPOModule
from mmpo.algos.sft import SFTModule
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig
from mmpo.training.lora import is_lora
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

TARGETS = ["q_proj", "v_proj", "gate_proj"]


@pytest.fixture(scope="module")
def text_path(tmp_path_factory) -> str:
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def batch(text_path):
    rows = make_items("long_arithmetic", 1, seed=0) + make_items("countdown", 1, seed=0)
    model, processor = load_vlm(text_path)
    torch.manual_seed(0)
    return rows, HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=5)


class FixedRollout(GRPOModule):
    """GRPO on a given rollout with fixed rewards (two groups of G = 2 with reward variance)."""

    fixed_rollout = None

    def build_rollout(self, rows):
        return self.fixed_rollout

    def compute_rewards(self, rollout):
        return torch.tensor([1.0, 0.0, 0.0, 1.0]), {}


def _log_probs(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        return completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)[0]


def test_lora_grpo_step_trains_only_adapters_and_the_reference_is_the_base_model(text_path, batch, tmp_path):
    rows, rollout = batch
    module = FixedRollout(text_path, sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                          loss=LossConfig(beta=0.1), optim=OptimConfig(lr=1e-2), rewards=RewardConfig(timeout_s=None),
                          lora_rank=4, lora_alpha=8, lora_target_modules=TARGETS, output_dir=str(tmp_path / "hf"))
    module.fixed_rollout = rollout
    assert is_lora(module.model) and module.reference_model is None  # no second copy of the weights
    trainable = [n for n, p in module.model.named_parameters() if p.requires_grad]
    # 3 target names x 2 layers, A and B each: no vision tower, so nothing else
    assert len(trainable) == 12 and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in before if "lora_B" in n} <= changed

    base, _ = load_vlm(text_path)
    with module.reference_policy() as reference:
        torch.testing.assert_close(_log_probs(reference, rollout), _log_probs(base, rollout), rtol=0, atol=1e-6)
    adapted = _log_probs(module.model, rollout)
    assert not torch.allclose(adapted, _log_probs(base, rollout), atol=1e-5)

    # the export: merged weights (a plain Qwen3ForCausalLM) computing the adapted log-probs, and the adapter
    module.save_hf()
    merged, processor = load_vlm(tmp_path / "hf")
    assert type(merged).__name__ == "Qwen3ForCausalLM" and not is_lora(merged)
    torch.testing.assert_close(_log_probs(merged, rollout), adapted, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(TARGETS)


def test_sft_lora_trains_adapters(text_path):
    rows = make_items("word_problem", 2, seed=1)
    module = SFTModule(text_path, lora_rank=4, lora_target_modules=TARGETS, gradient_checkpointing=True)
    loss, _ = module.sft_loss(rows)
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert all(g is not None for n, g in grads.items() if "lora_B" in n)


def test_freeze_vision_tower_is_refused_for_a_text_lm(text_path):
    with pytest.raises(ValueError, match="no vision tower"):
        GRPOModule(text_path, sampling=SamplingConfig(num_generations=2), freeze_vision_tower=True)
