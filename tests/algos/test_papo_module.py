"""PAPO as a Lightning module on a tiny Qwen2.5-VL: masked log-probs in the rollout, the
with-gradient option, and `mmpo fit` smoke runs of PAPO-G and PAPO-D."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + ["<think> </think><answer> </answer>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("papo_model"), corpus=corpus)


def _values(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def test_papo_g_fit_smoke_logs_perception_metrics(tiny_model, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("papo_g_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2")
    for key in ("papo/kl_prcp", "papo/entropy_orig", "papo/entropy_masked", "policy/clipfrac_high"):
        values = _values(rows, key)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), key
    assert all(v > 0 for v in _values(rows, "papo/kl_prcp"))  # k3 >= 0, and 0 only if the image did not matter
    assert all(v > 0 for v in _values(rows, "papo/entropy_orig"))
    assert _values(rows, "papo/gamma") == pytest.approx([0.02, 0.02])


def test_papo_g_fit_smoke_with_grad_and_annealing(tiny_model, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("papo_g_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
               "--model.init_args.masked_with_grad=true", "--model.init_args.gamma_end=0.0",
               "--model.init_args.eta_orig=0.05", "--model.init_args.eta_masked=0.05")
    # annealed linearly over max_steps = 2: 0.02 at step 0, 0.01 at step 1
    assert _values(rows, "papo/gamma") == pytest.approx([0.02, 0.01])
    assert all(math.isfinite(v) for v in _values(rows, "papo/kl_prcp"))


def test_papo_d_fit_smoke(tiny_model, tmp_path, fit_vlm_config, scripted_reward):
    # DAPO settings: no reference model, clip-higher, dynamic sampling. Scripted rewards per step
    # (2 prompts x G 2): [1, 0] varies, [1, 1] is constant -> exactly one group dropped each step
    weights = scripted_reward([1.0, 0.0, 1.0, 1.0])
    rows = fit_vlm_config("papo_d_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}")
    assert _values(rows, "rewards/dropped_groups") == [1.0, 1.0]
    assert _values(rows, "rewards/total/mean") == pytest.approx([0.75, 0.75])
    assert _values(rows, "rewards/frac_zero_std") == pytest.approx([0.5, 0.5])


def test_masked_log_probs_once_per_step_and_same_mask_when_recomputed(tiny_model):
    from mmpo.algos.papo import MASKED_LOG_PROBS, PAPOModule

    rows = make_items("count_shapes", 2, seed=1)
    module = PAPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                        loss=LossConfig(beta=0.0))
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    masked = rollout.extras[MASKED_LOG_PROBS]
    assert masked.shape == rollout.completion_ids.shape and not masked.requires_grad
    original, _ = module.sequence_log_probs(module.model, rollout)
    real = rollout.completion_mask.bool()
    assert torch.isfinite(masked[real]).all()
    assert not torch.allclose(masked[real], original.detach()[real])  # the image matters
    # with_grad recomputes from (seed, step, row id): same weights -> the same masked log-probs
    module.hparams.masked_with_grad = True
    recomputed = module._masked_log_probs(rollout)
    assert recomputed.requires_grad
    assert torch.allclose(recomputed.detach()[real], masked[real], atol=1e-5)
