"""`mmpo fit` with a user reward file that returns NaN, inf and finite values near float32's maximum
(3e38, whose group mean overflows to NaN): the non-finite values are rejected and the finite ones
clamped to |r| <= 1e6 before the advantages (mmpo.rewards.compute), both counted in the logged
metrics, and every step trains (no NaN advantage, no silently skipped step)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "grpo_tiny.yaml"

# per group of 4 completions: 3e38 (finite, clamped), NaN (rejected), +inf (rejected), 1.0 (kept)
REWARD_FILE = '''
def extreme(prompts, completions, **columns):
    pattern = [3e38, float("nan"), float("inf"), 1.0]
    return [pattern[i % 4] for i in range(len(completions))]
'''


def test_extreme_user_rewards_are_bounded_counted_and_trained_on(tmp_path, monkeypatch):
    from mmpo.algos.grpo import GRPOModule

    model = build_tiny_vlm(tmp_path / "tiny", corpus=[SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)],
                           vocab_size=400, hidden_size=64, intermediate_size=128)
    (tmp_path / "extreme_rewards.py").write_text(REWARD_FILE)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = GRPOModule.compute_advantages

    def recording(self, rewards, group_ids, rollout):
        advantages, metrics = original(self, rewards, group_ids, rollout)
        seen.append((rewards.clone(), advantages.clone()))
        return advantages, metrics

    monkeypatch.setattr(GRPOModule, "compute_advantages", recording)
    run = tmp_path / "run"
    assert main([
        "fit", "-c", str(CONFIG), f"--model.init_args.model_path={model}", "--model.init_args.output_dir=null",
        f"--model.init_args.rewards.weights={{{tmp_path / 'extreme_rewards.py'}:extreme: 1.0}}",
        "--model.init_args.sampling.num_generations=4", "--model.init_args.sampling.max_new_tokens=4",
        "--model.init_args.optim.lr=1e-3",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--data.init_args.tasks=[count_shapes,arithmetic]", "--data.init_args.train_size=4",
        "--data.init_args.batch_size=2",
    ]) == 0

    # each group's rewards: 3e38 -> 1e6, NaN and inf -> no reward from the only function (total 0), 1.0 kept
    assert len(seen) == 2
    for rewards, advantages in seen:
        assert rewards.tolist() == [1e6, 0.0, 0.0, 1.0] * 2
        # GRPO by hand: mean 250000.25, Bessel std sqrt(((1e6 - m)^2 + 2 m^2 + (1 - m)^2) / 3)
        mean = 250000.25
        std = math.sqrt(((1e6 - mean) ** 2 + 2 * mean ** 2 + (1 - mean) ** 2) / 3)
        expected = [(r - mean) / (std + 1e-6) for r in (1e6, 0.0, 0.0, 1.0)] * 2
        assert advantages.tolist() == pytest.approx(expected, rel=1e-5)
    (metrics_file,) = run.glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("losses/policy")]
    assert len(logged) == 2
    for row in logged:
        assert float(row["rewards/extreme/nonfinite"]) == 4.0  # NaN and inf in each of the 2 groups
        assert float(row["rewards/extreme/clamped"]) == 2.0  # 3e38 in each group
        assert float(row["rewards/total/clamped"]) == 0.0
        assert float(row["rewards/total/mean"]) == 250000.25
        assert float(row["perf/skipped_steps"]) == 0.0  # the step trained
        assert math.isfinite(float(row["losses/policy"])) and float(row["policy/grad_norm"]) > 0.0
