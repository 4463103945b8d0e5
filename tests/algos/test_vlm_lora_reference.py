"""LoRA for the VLM modules and a reference model that fits (issue 14, part 2).

- LoRA (peft): only adapter weights get gradients and change; the KL reference is the policy with
  its adapter disabled and equals the base model's log-probs; the merged export computes what the
  adapted model computes; ``freeze_vision_tower`` leaves the vision tower without gradient/adapters.
- Without LoRA: the reference copy takes ``ref_dtype`` (no transient full-precision copy) and
  ``ref_offload`` keeps it on CPU between passes with the same log-probs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from tiny_vlm_support import build_small_vlm
from torch.utils.data import DataLoader

from mmpo.algos.grpo import GRPOModule
from mmpo.algos.sft import SFTModule
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig
from mmpo.training.lora import is_lora
from mmpo.vlm.factory import load_vlm, make_reference_model, vision_tower_prefixes
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

TEXT_TARGETS = ["q_proj", "v_proj", "gate_proj"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_small_vlm(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def batch(tiny_path):
    rows = make_items("count_shapes", 2, seed=0)
    model, processor = load_vlm(tiny_path)
    torch.manual_seed(0)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=5)
    return rows, rollout


class FixedRollout(GRPOModule):
    """GRPO on a given rollout with fixed rewards (two groups of G = 2 with reward variance)."""

    fixed_rollout = None

    def build_rollout(self, rows):
        return self.fixed_rollout

    def compute_rewards(self, rollout):
        return torch.tensor([1.0, 0.0, 0.0, 1.0]), {}


def _lora_module(path: str, **settings) -> FixedRollout:
    return FixedRollout(path, sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                        loss=LossConfig(beta=0.1), optim=OptimConfig(lr=1e-2),
                        rewards=RewardConfig(timeout_s=None), lora_rank=4, lora_alpha=8,
                        lora_target_modules=TEXT_TARGETS, **settings)


def _log_probs(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        return completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)[0]


def _perturb_adapters(model) -> None:
    """peft starts lora_B at zero (adapted == base); give it values so the adapter changes outputs."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))


def _fit_one_step(module, rows) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))


def test_lora_step_changes_only_the_adapters_and_the_reference_is_the_base_model(tiny_path, batch):
    rows, rollout = batch
    module = _lora_module(tiny_path)
    module.fixed_rollout = rollout
    assert is_lora(module.model) and module.reference_model is None  # no second copy of the weights
    trainable = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 3 target names x 2 text layers, A and B each (the vision tower has no q_proj / v_proj; its MLP
    # has gate_proj: 1 vision block) -> (2 * 3 + 1) * 2 = 14 adapter tensors
    assert len(trainable) == 14
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    _fit_one_step(module, rows)
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)
    # lora_B starts at zero and gets a gradient, so every B moved (A only moves once B != 0)
    assert {n for n in before if "lora_B" in n} <= changed

    base, _ = load_vlm(tiny_path)
    with module.reference_policy() as reference:
        torch.testing.assert_close(_log_probs(reference, rollout), _log_probs(base, rollout), rtol=0, atol=1e-6)
    # outside the context the adapter is active again and the policy differs from the base
    assert not torch.allclose(_log_probs(module.model, rollout), _log_probs(base, rollout), atol=1e-5)


def test_lora_export_is_merged_weights_plus_adapter(tiny_path, batch, tmp_path):
    from peft import PeftModel

    rows, rollout = batch
    module = _lora_module(tiny_path, output_dir=str(tmp_path / "hf"))
    _perturb_adapters(module.model)
    adapted = _log_probs(module.model, rollout)
    module.save_hf()

    merged, _ = load_vlm(tmp_path / "hf")  # plain transformers, no peft
    assert not is_lora(merged)
    torch.testing.assert_close(_log_probs(merged, rollout), adapted, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == sorted(TEXT_TARGETS)
    base, _ = load_vlm(tiny_path)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter")
    torch.testing.assert_close(_log_probs(reloaded, rollout), adapted, rtol=0, atol=1e-5)


def test_freeze_vision_tower(tiny_path):
    # full fine-tuning: vision weights frozen, every other weight trains
    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.0), freeze_vision_tower=True)
    (prefix,) = vision_tower_prefixes(module.model)
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    assert frozen and frozen == {n for n, _ in module.model.named_parameters() if n.startswith(prefix + ".")}
    # LoRA on a name the vision MLP shares (gate_proj): adapters in the text layers only
    lora = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                      loss=LossConfig(beta=0.0), lora_rank=2,
                      lora_target_modules=["gate_proj"], freeze_vision_tower=True)
    adapters = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert len(adapters) == 4 and not any(".visual." in n for n in adapters)  # 2 text layers x (A, B)
    unfrozen = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                          loss=LossConfig(beta=0.0), lora_rank=2,
                          lora_target_modules=["gate_proj"])
    assert sum(".visual." in n for n, p in unfrozen.model.named_parameters() if p.requires_grad) == 2


def test_sft_lora_trains_adapters_with_gradient_checkpointing(tiny_path):
    rows = make_items("count_shapes", 2, seed=1)
    module = SFTModule(tiny_path, lora_rank=4, lora_target_modules=TEXT_TARGETS, gradient_checkpointing=True)
    loss, _ = module.sft_loss(rows)
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    # the checkpointed segments back-propagate into the adapters although the embeddings are frozen
    assert all(g is not None for n, g in grads.items() if "lora_B" in n)


def test_lora_settings_are_checked(tiny_path):
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        GRPOModule(tiny_path, lora_rank=-1)
    with pytest.raises(ValueError, match="none of the LoRA target modules"):
        GRPOModule(tiny_path, lora_rank=2, lora_target_modules=["c_attn"])


def test_reference_copy_in_bfloat16_is_cast_while_copied(tiny_path, batch):
    _, rollout = batch
    model, _ = load_vlm(tiny_path)
    reference = make_reference_model(model, 0.1, dtype=torch.bfloat16)
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert all(not p.requires_grad for p in reference.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy is untouched
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q), name
    # log-probs of the bf16 reference: those of the fp32 model up to bf16 rounding (8 mantissa bits)
    torch.testing.assert_close(_log_probs(reference, rollout), _log_probs(model, rollout), rtol=0, atol=0.1)

    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.1), ref_dtype="bfloat16")
    assert {p.dtype for p in module.reference_model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="ref_dtype must be"):
        GRPOModule(tiny_path, ref_dtype="half")


def test_ref_offload_moves_the_reference_for_its_pass_only(tiny_path, batch, monkeypatch):
    rows, rollout = batch
    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                        loss=LossConfig(beta=0.1), ref_offload=True)
    # a pretend accelerator: the spy records where the reference is sent (it stays on the CPU here)
    monkeypatch.setattr(GRPOModule, "device", property(lambda self: torch.device("cuda", 7)))
    moves: list[str] = []
    monkeypatch.setattr(module.reference_model, "to", lambda device: moves.append(str(device)))
    module.on_fit_start()
    assert moves == []  # offloaded: not moved to the device at fit start
    with module.reference_policy() as reference:
        assert reference is module.reference_model and moves == ["cuda:7"]
    assert moves == ["cuda:7", "cpu"]

    kept_module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=2),
                             loss=LossConfig(beta=0.1))
    monkeypatch.setattr(kept_module.reference_model, "to", lambda device: moves.append(str(device)))
    moves.clear()
    kept_module.on_fit_start()
    with kept_module.reference_policy():
        pass
    assert moves == ["cuda:7"]  # kept on the device: moved once, at fit start


def test_ref_offload_gives_the_same_training_step(tiny_path, batch):
    rows, rollout = batch

    def step(offload: bool) -> tuple[dict, torch.Tensor]:
        module = FixedRollout(tiny_path, sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                              loss=LossConfig(beta=0.1),
                              rewards=RewardConfig(timeout_s=None), ref_offload=offload)
        module.fixed_rollout = rollout
        with torch.no_grad():  # a reference that differs from the policy, so the KL is not zero
            next(module.reference_model.parameters()).add_(0.05)
        _fit_one_step(module, rows)
        with module.reference_policy() as reference:
            return module.last_metrics, _log_probs(reference, rollout)

    kept_metrics, kept = step(offload=False)
    offloaded_metrics, offloaded = step(offload=True)
    torch.testing.assert_close(offloaded, kept, rtol=0, atol=0)
    assert kept_metrics["losses/kl"] > 0
    assert offloaded_metrics["losses/kl"] == kept_metrics["losses/kl"]


def test_grpo_tiny_lora_config_runs_through_mmpo_fit(tiny_path, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0])  # reward variance in every group: the adapter gets a gradient
    out = tmp_path / "hf"
    rows = fit_vlm_config("grpo_tiny_lora.yaml", tiny_path, tmp_path / "run", "--model.init_args.sampling.num_generations=2",
                          "--data.init_args.batch_size=2", f"--model.init_args.output_dir={out}",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}")
    steps = [r for r in rows if r.get("losses/total")]
    assert len(steps) == 2
    # step 1: the adapter is still zero (lora_B = 0), so policy == reference and the KL is exactly 0;
    # step 2: the adapter has moved the policy away from its adapter-disabled self
    assert float(steps[0]["losses/kl"]) == 0.0 and float(steps[1]["losses/kl"]) > 0.0
    merged, _ = load_vlm(out)
    base, _ = load_vlm(tiny_path)
    named = dict(base.named_parameters())
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, named[n])}
    # only the adapted text projections changed; the vision tower is frozen and has no adapter
    assert changed and all(n.rsplit(".", 2)[-2] in TEXT_TARGETS + ["k_proj", "o_proj", "up_proj", "down_proj"]
                           for n in changed)
    assert not any(".visual." in n for n in changed)
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_lora_checkpoint_restores_the_adapter(tiny_path, batch, tmp_path):
    rows, rollout = batch
    module = _lora_module(tiny_path)
    module.fixed_rollout = rollout
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    fresh = _lora_module(tiny_path)
    fresh.load_state_dict(checkpoint["state_dict"])  # strict: the same peft keys, nothing missing
    trained = dict(module.model.named_parameters())
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, trained[name]), name
    assert checkpoint["hyper_parameters"]["lora_rank"] == 4
