"""`mmpo fit -c configs/llm/tarot_grpo_tiny.yaml`: GRPO on the tiny text LM with TAROT's reward from two
encoders trains 2 steps, and the logged reward and its parts are the encoders' values on the sampled texts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from mmpo.cli import main
from mmpo.rewards.models import MODEL_REWARDS
from mmpo.rewards.tarot import TextEncoder, tarot_rewards
from mmpo.vlm.factory import build_tiny_reward_model
from tiny_vlm_support import TEXT_TEST_TASKS, build_small_text_lm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llm" / "tarot_grpo_tiny.yaml"


def test_tarot_grpo_trains_two_steps(tmp_path, monkeypatch):
    from mmpo.algos.grpo import GRPOModule

    policy = build_small_text_lm(tmp_path / "policy")
    encoder = str(build_tiny_reward_model(tmp_path / "enc", corpus=["a text written by someone"] * 4, num_labels=4))
    models = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["rewards"]["models"]
    models["tarot"]["style_encoder"]["path"] = models["tarot"]["semantic_encoder"]["path"] = encoder
    seen = []
    original = GRPOModule.compute_rewards

    def recording(self, rollout):
        seen.append((list(rollout.texts), [dict(row) for row in rollout.rows]))
        return original(self, rollout)

    monkeypatch.setattr(GRPOModule, "compute_rewards", recording)
    MODEL_REWARDS.clear()
    assert main([
        "fit", "-c", str(CONFIG), f"--model.init_args.model_path={policy}", "--model.init_args.output_dir=null",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=6",
        f"--model.init_args.rewards.models={json.dumps(models)}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}", f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        f"--data.init_args.tasks=[{','.join(TEXT_TEST_TASKS)}]", "--data.init_args.train_size=4",
        "--data.init_args.batch_size=2",
    ]) == 0
    MODEL_REWARDS.clear()
    (metrics_file,) = (tmp_path / "run").glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("rewards/total/mean")]
    assert len(seen) == len(logged) == 2
    style, semantic = TextEncoder(encoder, pooling="logits"), TextEncoder(encoder, pooling="mean")
    for (texts, rows), metrics in zip(seen, logged):
        sources = [row["problem"] for row in rows]
        total, privacy, utility = tarot_rewards(style(sources), style(texts), semantic(sources), semantic(texts))
        assert float(metrics["rewards/tarot/mean"]) == pytest.approx(float(total.mean()), abs=1e-5)
        assert float(metrics["rewards/tarot/privacy"]) == pytest.approx(float(privacy.mean()), abs=1e-5)
        assert float(metrics["rewards/tarot/utility"]) == pytest.approx(float(utility.mean()), abs=1e-5)
