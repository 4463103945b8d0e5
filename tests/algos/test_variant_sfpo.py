"""SFPO through the VLM module path (arXiv 2510.04072): with K = 1 and alpha = 1 the slow-fast update is
two plain updates with pi_old fixed (= GRPO with mu = 2); alpha < 1 moves elsewhere; the switch state
goes through a real checkpoint; the tiny config runs through `mmpo fit`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmpo.training.config import LossConfig, SamplingConfig


CONFIG = "variants/sfpo_tiny.yaml"



def _weights(root: Path) -> dict[str, torch.Tensor]:
    (path,) = root.glob("hf/*.safetensors")
    return load_file(path)


def _fit(fit_vlm_config, tiny_model, root, weights, *overrides):
    return fit_vlm_config(CONFIG, tiny_model, root, "--model.init_args.sampling.num_generations=2",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}",
                          f"--model.init_args.output_dir={root / 'hf'}", "--trainer.enable_checkpointing=false",
                          "--trainer.callbacks=[]", "--model.init_args.optim.lr=1e-3", *overrides)


def test_k1_alpha1_equals_two_plain_updates(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    weights = scripted_reward([1.0, 0.0])
    # SFPO K = 1, alpha = 1: fast update, reposition to the fast weights, slow update: 2 optimizer steps
    rows = _fit(fit_vlm_config, tiny_model, tmp_path / "sfpo", weights, "--model.init_args.sfpo_inner_steps=1",
                "--model.init_args.sfpo_alpha=1.0")
    # GRPO with mu = 2 on the same batch: the same two updates, pi_old = theta_0 in both
    _fit(fit_vlm_config, tiny_model, tmp_path / "grpo", weights, "--model.class_path=mmpo.algos.grpo.GRPOModule",
         "--model.init_args.optim.mu=2")
    # SFPO alpha = 0.5: the slow update starts halfway, so the end point differs
    _fit(fit_vlm_config, tiny_model, tmp_path / "half", weights, "--model.init_args.sfpo_inner_steps=1",
         "--model.init_args.sfpo_alpha=0.5")
    sfpo, grpo, half = (_weights(tmp_path / name) for name in ("sfpo", "grpo", "half"))
    # GRPO with mu = 2 shuffles the batch each epoch (SFPO's on-policy passes do not): float rounding of
    # the reordered sums, amplified by AdamW at lr 1e-3, leaves ~2e-5; alpha = 0.5 moves ~2e-3 away
    gap = max(float((sfpo[name] - value).abs().max()) for name, value in grpo.items())
    half_gap = max(float((half[name] - value).abs().max()) for name, value in grpo.items())
    assert gap < 1e-4
    assert half_gap > 10 * 1e-4
    logged = [r for r in rows if r.get("sfpo/active")]
    assert logged and float(logged[0]["sfpo/active"]) == 1.0


def test_switch_state_through_a_checkpoint(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    from mmpo.algos.sfpo import SFPOModule

    weights = scripted_reward([1.0, 0.0])
    ckpt_dir = tmp_path / "ckpt"
    fit_vlm_config(CONFIG, tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
                   f"--model.init_args.rewards.weights={json.dumps(weights)}", "--model.init_args.sfpo_inner_steps=1",
                   f"--trainer.callbacks.init_args.dirpath={ckpt_dir}", "--trainer.callbacks.init_args.every_n_train_steps=1",
                   "--trainer.max_steps=4")  # 2 batches x (K + 1 = 2) optimizer steps
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False, map_location="cpu")
    state = checkpoint["sfpo_switch"]
    assert len(state["entropies"]) == 2 and state["stopped"] is False
    resumed = SFPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                         loss=LossConfig(beta=0.0))
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.update_wrapper.switch.entropies == state["entropies"]
    with pytest.raises(ValueError, match="sfpo_alpha"):
        SFPOModule(str(tiny_model), sfpo_alpha=1.5)
