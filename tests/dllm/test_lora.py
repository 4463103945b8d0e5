"""LoRA (peft) for DiffuGRPO: adapter-only training, adapter-disabled KL reference, merged export."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from mmpo.dllm.data import ArithmeticDataModule
from mmpo.training.lora import LoraSettings, is_lora, merged_state_dict, wrap_with_lora
from mmpo.dllm.modeling import load_mask_predictor, mask_predictor_logits, save_mask_predictor
from mmpo.dllm.rl import DiffuGRPO
from mmpo.dllm.sampler import SamplerConfig

TINY_TARGETS = ["Wqkv", "Wo", "Wi"]  # ModernBERT's Linear layers (LLaDA's are q_proj, k_proj, ...)


def _ids(tokenizer):
    ids = tokenizer(["3+4*2", "9-1+5"], padding=True, return_tensors="pt")
    return ids["input_ids"], ids["attention_mask"]


def test_lora_wraps_only_the_targets_and_starts_as_the_base(tiny_model_and_tokenizer):
    import copy

    model, tokenizer = tiny_model_and_tokenizer
    input_ids, attention = _ids(tokenizer)
    base_logits = mask_predictor_logits(model, input_ids, attention)
    wrapped = wrap_with_lora(copy.deepcopy(model), LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=TINY_TARGETS))
    assert is_lora(wrapped) and not is_lora(model)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # B starts at zero: the adapted network equals the base until it trains
    assert torch.allclose(mask_predictor_logits(wrapped.eval(), input_ids, attention), base_logits)
    with pytest.raises(ValueError, match="Linear layers are named"):
        wrap_with_lora(copy.deepcopy(model), LoraSettings(target_modules=["q_proj", "v_proj"]))


def test_merged_state_dict_is_base_plus_scaled_delta(tiny_model_and_tokenizer):
    import copy

    model, _ = tiny_model_and_tokenizer
    wrapped = wrap_with_lora(copy.deepcopy(model), LoraSettings(r=2, alpha=6, dropout=0.0, target_modules=["Wi"]))
    layer = wrapped.get_base_model().model.layers[0].mlp.Wi
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_()
    state = merged_state_dict(wrapped)
    key = "model.layers.0.mlp.Wi.weight"
    expected = model.state_dict()[key] + (6 / 2) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(state[key], expected, atol=1e-6)
    assert set(state) == set(model.state_dict())  # the base model's own key names, no lora_ keys


def test_diffugrpo_with_lora_trains_the_adapter_against_the_disabled_adapter(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    module = DiffuGRPO(
        model_path=str(tmp_path / "start"), warmup_config=None, save_dir=str(tmp_path / "out"), group_size=4,
        optim={"mu": 2, "lr": 1e-2, "warmup_steps": 1}, loss={"beta": 0.05}, igpo={"enabled": False},
        sampler=SamplerConfig(gen_length=16, block_length=8, steps=8, temperature=1.2),
        lora=LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=TINY_TARGETS),
    )
    # a random-init model is never right: score every other rollout as correct so advantages are non-zero
    module._score = lambda texts, answers: torch.arange(len(texts)) % 2 == 0
    assert module.ref_model is None  # no second copy: the reference is the adapter-disabled network
    base_before = {k: v.clone() for k, v in module.model.get_base_model().state_dict().items() if "lora_" not in k}
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              num_sanity_val_steps=0).fit(module, datamodule=ArithmeticDataModule(train_size=8, test_size=4, val_size=2,
                                                                                  batch_size=2))
    base_after = {k: v for k, v in module.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before), "frozen base weights moved"
    lora_b = [p for n, p in module.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b), "the adapter did not train"

    input_ids, attention = _ids(tokenizer)
    module.model.eval()
    with module.model.disable_adapter():
        disabled = mask_predictor_logits(module.model, input_ids, attention)
    assert torch.allclose(disabled, mask_predictor_logits(model, input_ids, attention), atol=1e-5)

    # the export is a plain checkpoint (no peft needed to load) equal to the adapted network
    exported, _ = load_mask_predictor(str(tmp_path / "out"))
    assert not is_lora(exported)
    adapted = mask_predictor_logits(module.model, input_ids, attention)
    assert torch.allclose(mask_predictor_logits(exported.eval(), input_ids, attention), adapted, atol=1e-5)
    assert not torch.allclose(adapted, disabled, atol=1e-4)
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()


def test_merged_state_dict_refuses_a_dora_adapter():
    """The merged export adds plain LoRA deltas; a DoRA adapter (which mmpo's settings never build) would be
    merged wrongly, so it is refused by name."""
    import pytest
    import torch
    from peft import LoraConfig, get_peft_model

    from mmpo.training.lora import merged_state_dict

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    plain = get_peft_model(Net(), LoraConfig(r=2, target_modules=["proj"]))
    assert torch.equal(merged_state_dict(plain)["proj.weight"], plain.get_base_model().proj.base_layer.weight)
    dora = get_peft_model(Net(), LoraConfig(r=2, target_modules=["proj"], use_dora=True))
    with pytest.raises(ValueError, match="proj: a DoRA adapter"):
        merged_state_dict(dora)
