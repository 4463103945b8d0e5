"""Each of verl's advantage estimators trains 2 steps through `mmpo fit -c configs/vlm/grpo_tiny.yaml`
with `--model.init_args.advantage.name=<name>`, and the module feeds the loss exactly what the core
estimator gives for that step's rewards, mask and (ReMax) greedy baselines."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.core import compute_advantages
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "grpo_tiny.yaml"
PER_TOKEN = {"reinforce_plus_plus", "reinforce_plus_plus_baseline", "optimal_token_baseline",
             "tir_optimal_token_baseline"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                          intermediate_size=128)


@pytest.mark.parametrize(("name", "generations"), [
    *[(name, 2) for name in ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "remax",
                             "optimal_token_baseline", "tir_optimal_token_baseline"]],
    # one sample per prompt, as verl and OpenRLHF run REINFORCE++ (and ReMax, whose baseline is the greedy rollout)
    ("reinforce_plus_plus", 1), ("reinforce_plus_plus_baseline", 1), ("remax", 1)])
def test_verl_advantage_trains_two_steps(name, generations, tiny_path, tmp_path, monkeypatch):
    from mmpo.algos.grpo import GRPOModule

    seen: list[dict] = []
    original = GRPOModule.compute_advantages
    original_baselines = GRPOModule.greedy_reward_baselines
    greedy: list[torch.Tensor] = []
    original_stats = GRPOModule.rollout_token_statistics
    stats: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording_stats(self, rollout):
        stats.append(original_stats(self, rollout))
        return stats[-1]

    def recording_baselines(self, rollout):
        greedy.append(original_baselines(self, rollout))
        return greedy[-1]

    def recording(self, rewards, group_ids, rollout):
        advantages, metrics = original(self, rewards, group_ids, rollout)
        seen.append(dict(rewards=rewards.clone(), group_ids=group_ids.clone(),
                         mask=rollout.completion_mask.clone(), advantages=advantages.clone()))
        return advantages, metrics

    monkeypatch.setattr(GRPOModule, "compute_advantages", recording)
    monkeypatch.setattr(GRPOModule, "greedy_reward_baselines", recording_baselines)
    monkeypatch.setattr(GRPOModule, "rollout_token_statistics", recording_stats)
    run = tmp_path / "run"
    assert main([
        "fit", "-c", str(CONFIG), f"--model.init_args.model_path={tiny_path}", "--model.init_args.output_dir=null",
        f"--model.init_args.advantage.name={name}", f"--model.init_args.sampling.num_generations={generations}",
        "--model.init_args.sampling.max_new_tokens=4", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run}",
        f"--trainer.logger.init_args.save_dir={run}", f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--data.init_args.tasks=[count_shapes,arithmetic]", "--data.init_args.train_size=4",
        "--data.init_args.batch_size=2",
    ]) == 0

    assert len(seen) == 2  # one rollout per optimizer step
    assert len(greedy) == (2 if name == "remax" else 0)  # the extra greedy rollout only for ReMax
    assert len(stats) == (2 if name.endswith("optimal_token_baseline") else 0)  # the extra forward only for OTB
    for step, record in enumerate(seen):
        # batch_size 2 prompts x G: every group has G samples
        assert torch.unique(record["group_ids"], return_counts=True)[1].tolist() == [generations] * 2
        mask = record["mask"].float()
        inputs = {"mask": mask} if name in PER_TOKEN | {"opo"} else {}
        if name == "remax":
            inputs = {"reward_baselines": greedy[step]}
        if name.endswith("optimal_token_baseline"):
            old_log_probs, sum_pi_squared = stats[step]
            assert bool((sum_pi_squared[mask > 0] <= 1).all()) and bool((old_log_probs[mask > 0] <= 0).all())
            inputs["old_log_probs"], inputs["sum_pi_squared"] = old_log_probs, sum_pi_squared
        expected = compute_advantages(name, record["rewards"], record["group_ids"], **inputs)
        torch.testing.assert_close(record["advantages"], expected)
        assert record["advantages"].shape == (mask.shape if name in PER_TOKEN else mask.shape[:1])
    (metrics_file,) = run.glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("losses/policy")]
    assert len(logged) == 2 and all(row["rewards/frac_zero_std"] for row in logged)
    if name == "remax":
        assert [float(r["advantages/remax_baseline_mean"]) for r in logged] == pytest.approx(
            [float(g.mean()) for g in greedy])
    if name == "gpg":
        assert all(float(r["advantages/gpg_alpha"]) >= 1.0 for r in logged)
