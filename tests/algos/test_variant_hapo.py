"""HAPO through the module path (arXiv 2509.16591): the adaptive-temperature processor by hand, the
entropy statistics (trainer state) through a real checkpoint, and a 2-step `mmpo fit` of hapo_tiny.yaml
whose second rollout samples with the first step's statistics."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmpo.core.hapo import EntropyNormStats
from mmpo.training.config import LossConfig, SamplingConfig

CONFIG = "variants/hapo_tiny.yaml"



def test_adaptive_temperature_processor_hand_computed():
    from mmpo.algos.hapo import AdaptiveTemperatureProcessor

    stats = EntropyNormStats(pivot=0.0, scale=1.0, scale_pos=0.5, scale_neg=-1.0)
    processor = AdaptiveTemperatureProcessor(stats, tau=0.05, temperature=1.0, signed=False)
    scores = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    out = processor(torch.zeros(2, 1, dtype=torch.long), scores)
    # row 0: p = (0.731059, 0.268941), H = 0.582203, x = log H = -0.540899 <= 0 -> h^ = x / -1 = 0.540899
    #   factor 1 + 0.05 * 0.540899 = 1.027045 -> logits / 1.027045
    p = 1 / (1 + math.exp(-1))
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    factor0 = 1 + 0.05 * -math.log(entropy)
    # row 1: H = ln 2, x = -0.366513 -> h^ = 0.366513, factor 1.018326
    factor1 = 1 + 0.05 * -math.log(math.log(2))
    assert out[0].tolist() == pytest.approx([1 / factor0, 0.0], rel=1e-6)
    assert out[1].tolist() == pytest.approx([3 / factor1, 3 / factor1], rel=1e-6)
    # a suppressed token (-inf, as the engine's vision-token suppression leaves it) changes nothing else
    suppressed = processor(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[1.0, 0.0, -math.inf],
                                                                               [3.0, 3.0, -math.inf]]))
    assert torch.allclose(suppressed[:, :2], out, rtol=1e-6)
    assert suppressed[:, 2].tolist() == [-math.inf, -math.inf]


def test_fit_uses_the_previous_steps_statistics_and_checkpoints_them(tiny_model, tmp_path, fit_vlm_config,
                                                                     scripted_reward, monkeypatch):
    from mmpo.algos.hapo import AdaptiveTemperatureProcessor, HAPOModule
    from mmpo.vlm.rollout import HFGenerateEngine

    seen: list[list] = []
    original = HFGenerateEngine.generate

    def recording(self, rows, **kwargs):
        seen.append(list(kwargs.get("logits_processors", ())))
        return original(self, rows, **kwargs)

    monkeypatch.setattr(HFGenerateEngine, "generate", recording)
    weights = scripted_reward([1.0, 0.0])
    ckpt_dir = tmp_path / "ckpt"
    rows = fit_vlm_config(CONFIG, tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2",
                          f"--model.init_args.rewards.weights={json.dumps(weights)}",
                          f"--trainer.callbacks.init_args.dirpath={ckpt_dir}",
                          "--trainer.callbacks.init_args.every_n_train_steps=1")
    # step 1 samples at the plain temperature (no statistics yet); step 2 with the adaptive processor
    assert [len(p) for p in seen] == [0, 1] and isinstance(seen[1][0], AdaptiveTemperatureProcessor)
    logged = [r for r in rows if r.get("hapo/temperature_mean")]
    assert len(logged) == 2
    for row in logged:  # official h^ in [0, 1]: T_t in [1, 1.05]
        assert 1.0 <= float(row["hapo/temperature_mean"]) <= 1.05
        assert float(row["advantages/hapo_fallback_groups"]) >= 0.0
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False, map_location="cpu")
    state = checkpoint["hapo_entropy_stats"]
    assert state["pivot"] == pytest.approx(float(logged[1]["hapo/entropy_pivot"]), rel=1e-6)
    resumed = HAPOModule(str(tiny_model), sampling=SamplingConfig(num_generations=2),
                         loss={"beta": 0.0})
    assert resumed.entropy_stats.stats is None
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.entropy_stats.stats == EntropyNormStats(**state)
    assert resumed.loss.name == "hapo" and resumed.loss.dual_clip == 10.0
