"""`mmpo estimate` for text-only LM configs (issue 38): exact dimensions of a text config (no vision tower,
no image tokens), the tiny text config from its local checkpoint, and the real-size configs' comments
(FSDP2 on 8 GPUs, and LoRA on one) quoting what `mmpo estimate` prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tiny_vlm_support import build_small_text_lm

from mmpo.cli import main
from mmpo.vlm.estimate_cli import config_comment, estimate_config, run_shape
from mmpo.vlm.memory import architecture_dims, model_dims, peak_gb

REPO = Path(__file__).resolve().parents[2]
REAL_SIZE = {"grpo_qwen2_5_7b_instruct": "qwen2.5-7b-instruct", "grpo_qwen3_8b": "qwen3-8b"}
LORA_ON_ONE = ["trainer.strategy=auto", "model.init_args.lora_rank=64", "model.init_args.optim.micro_batch_size=1"]


def test_qwen3_8b_dimensions_by_hand():
    dims = architecture_dims("qwen3-8b")
    h, i, layers, vocab, kv = 4096, 12288, 36, 151936, 8 * 128
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h + 2 * 128  # q, o, k, v, MLP, 2 norms, q/k norms
    assert dims.text_only and dims.vision_params == 0
    assert dims.num_params == 2 * vocab * h + layers * per_layer + h  # untied embeddings, final norm
    assert (dims.num_layers, dims.num_kv_heads, dims.hidden_size) == (36, 8, 4096)


def test_estimate_on_the_tiny_text_config(tmp_path, capsys):
    from mmpo.vlm.factory import load_vlm

    model_path = build_small_text_lm(tmp_path / "text")
    config = yaml.safe_load((REPO / "configs" / "llm" / "grpo_tiny.yaml").read_text())
    config["model"]["init_args"]["model_path"] = model_path
    path = tmp_path / "grpo_tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["estimate", "-c", str(path)]) == 0
    printed = capsys.readouterr().out
    budget, _ = estimate_config(path)
    model, _ = load_vlm(model_path)
    num_params = sum(p.numel() for p in model.parameters())
    from transformers import AutoConfig

    assert model_dims(AutoConfig.from_pretrained(model_path)).num_params == num_params
    assert budget["weights"] == num_params * 4 and budget["reference"] == 0  # float32, beta 0
    run = run_shape(config, dims=model_dims(AutoConfig.from_pretrained(model_path)))
    # a text LM: no image tokens; the prompt is the assumed 256 text tokens
    assert (run.image_pixels, run.prompt_tokens, run.micro_batch, run.completion_tokens) == (0, 256, 64, 64)
    assert "image tokens" not in printed


@pytest.mark.parametrize("name", sorted(REAL_SIZE))
def test_real_size_text_config_comments_quote_mmpo_estimate(name):
    arch = REAL_SIZE[name]
    relative = Path("configs") / "llm" / f"{name}.yaml"
    text = (REPO / relative).read_text()
    budget, _ = estimate_config(REPO / relative, architecture=arch)
    assert config_comment(budget, f"mmpo estimate -c {relative} --arch {arch}") in text, (
        f"refresh with: mmpo estimate -c {relative} --arch {arch} --comment --update-config")
    assert budget["reference"] > 0 and budget["gathered_weights"] > 0  # FSDP2 over 8 GPUs, beta 0.01
    lora, _ = estimate_config(REPO / relative, devices=1, architecture=arch, overrides=LORA_ON_ONE)
    assert lora["reference"] == 0 and lora["gradients"] < budget["gradients"]
    assert config_comment(lora, "-").splitlines()[1] in text.split("On ONE GPU with LoRA")[1]
    assert f"peak {peak_gb(lora)} GB" in text
