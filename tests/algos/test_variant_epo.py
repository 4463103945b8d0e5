"""EPO through the module path (arXiv 2509.22576): the smoothing part by hand, the entropy history
(trainer state) through a real checkpoint and back, and a 2-step `mmpo fit` of epo_tiny.yaml."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.core import Aggregation
from mmpo.training.config import LossConfig, SamplingConfig
from mmpo.training.step_state import StepState

CONFIG = "variants/epo_tiny.yaml"



def _outputs():
    entropy = torch.tensor([[0.2, 1.0, 2.0], [1.4, 0.6, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return {"entropy": entropy, "mask": mask, "aggregation": Aggregation("token-mean", global_tokens=5.0),
            "step": StepState(step=0, rows=[])}


def test_smoothing_part_hand_computed(tiny_model):
    from mmpo.algos.epo import EPOModule

    module = EPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                       loss={"beta": 0.0})
    parts, metrics = module.extra_loss_terms(None, _outputs())
    # no history yet: no penalty
    assert float(parts.weighted("epo_smooth")) == 0.0 and metrics["epo/history_mean"] == 0.0
    module.entropy_history.update(0.8)
    module.entropy_history.update(1.2)  # H_hist = 1.0: band (0.5, 1.5)
    parts, metrics = module.extra_loss_terms(None, _outputs())
    # P = 0.1 on tokens 0.2 and 2.0 -> token-mean 0.2 / 5 = 0.04; coefficient lambda_H * kappa = 0.001
    assert float(parts["epo_smooth"]) == pytest.approx(0.04)
    assert parts.coefficient("epo_smooth") == pytest.approx(0.001)
    assert float(metrics["epo/within_frac"]) == pytest.approx(0.6) and metrics["epo/history_mean"] == 1.0
    phased = EPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                       loss={"beta": 0.0}, epo_phase_weights=True)
    phased.entropy_history.load_state_dict(module.entropy_history.state_dict())
    parts, metrics = phased.extra_loss_terms(None, _outputs())
    assert metrics["epo/phase_weight"] == 1.0  # epoch 0: w = 1
    with pytest.raises(ValueError, match="epo_mask_mode"):
        EPOModule(str(tiny_model), epo_mask_mode="sequence")
    with pytest.raises(ValueError, match="entropy_coef"):
        EPOModule(str(tiny_model), loss={"entropy_coef": 0.0})


def test_fit_history_and_checkpoint_round_trip(tiny_model, tmp_path, fit_vlm_config):
    from mmpo.algos.epo import EPOModule

    ckpt_dir = tmp_path / "ckpt"
    rows = fit_vlm_config(CONFIG, tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
                          f"--trainer.callbacks.init_args.dirpath={ckpt_dir}",
                          "--trainer.callbacks.init_args.every_n_train_steps=1")
    logged = [r for r in rows if r.get("epo/history_mean")]
    assert len(logged) == 2
    first, second = (float(r["entropy"]) for r in logged)
    assert float(logged[0]["epo/history_mean"]) == 0.0  # step 1 has no history
    # step 2's H_hist is step 1's token-mean entropy (one optimizer step of one micro-batch per step)
    assert float(logged[1]["epo/history_mean"]) == pytest.approx(first, rel=1e-6)
    assert math.isfinite(float(logged[1]["losses/epo_smooth"]))
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False, map_location="cpu")
    state = checkpoint["epo_entropy_history"]
    assert state["count"] == 2 and state["total"] == pytest.approx(first + second, rel=1e-6)
    resumed = EPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                        loss={"beta": 0.0})
    assert resumed.entropy_history.mean is None
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.entropy_history.count == 2
    assert resumed.entropy_history.mean == pytest.approx((first + second) / 2, rel=1e-6)
