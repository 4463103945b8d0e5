"""`mmpo fit -c configs/vlm/mpo_tiny.yaml` trains 2 steps on the MPO testbed with a rubric update after each
batch; the rubric is written per iteration and checkpointed, and a resumed run judges with the rubric it had
reached."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from mmpo.algos.mpo import rubric_items
from mmpo.cli import main
from mmpo.rewards.models import MODEL_REWARDS
from tiny_vlm_support import build_small_vlm, tiny_grpo_fit_args

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "mpo_tiny.yaml"


def test_mpo_fits_two_steps_checkpoints_and_resumes_the_rubric(tmp_path, monkeypatch):
    from mmpo.algos.mpo import MPOModule

    tiny = build_small_vlm(tmp_path / "tiny")
    rubrics: list[str] = []
    original = MPOModule.compute_rewards

    def recording(self, rollout):
        rubrics.append(self.rubric_state.rubric)
        return original(self, rollout)

    monkeypatch.setattr(MPOModule, "compute_rewards", recording)
    MODEL_REWARDS.clear()
    overrides = ["--model.init_args.mpo_interval=1", f"--model.init_args.mpo_rubric_dir={tmp_path / 'rubrics'}"]
    assert main(tiny_grpo_fit_args(CONFIG, tiny, tmp_path, *overrides)) == 0
    (metrics_file,) = tmp_path.glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("rewards/total/mean")]
    assert len(logged) == 2
    assert [float(row["mpo/rubric_iteration"]) for row in logged] == [0.0, 1.0]
    assert "mpo/oracle_mean" in logged[0] and float(logged[0]["rewards/judge/errors"]) == 0.0
    first = (tmp_path / "rubrics" / "evaluation_rubric_iter_0.txt").read_text()
    assert rubric_items(first) == ['mentions "answer"', "at least 8 words"] and rubrics[0] == first.strip()
    # every batch was followed by a rubric update: rubric_1 judged batch 2, rubric_2 is the last
    assert rubrics[1] == (tmp_path / "rubrics" / "evaluation_rubric_iter_1.txt").read_text().strip()
    last = (tmp_path / "rubrics" / "evaluation_rubric_iter_2.txt").read_text().strip()

    (ckpt,) = (tmp_path / "ckpt").glob("last*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["mpo_rubric"]
    assert state["iteration"] == 2 and state["batches"] == 2 and state["rubric"] == last and state["samples"] == []

    rubrics.clear()
    MODEL_REWARDS.clear()
    resumed = tiny_grpo_fit_args(CONFIG, tiny, tmp_path / "resumed", *overrides)
    resumed[resumed.index("--trainer.max_steps=2")] = "--trainer.max_steps=3"
    assert main([*resumed, f"--ckpt_path={ckpt}"]) == 0
    assert rubrics == [last]  # step 3 is judged with the rubric the first run reached


def test_mpo_hacking_config_fits_two_steps(tmp_path, monkeypatch):
    """configs/vlm/mpo_hacking_tiny.yaml (length rubric, dropping meta judge) trains 2 steps; 4 new tokens cannot
    reach 16 words, so every judge score is 0, nothing is gamed and the rewritten rubric keeps the five items."""
    from mmpo.algos.mpo import MPOModule
    from mmpo.algos.mpo_testbed import HACKING_RUBRIC, DroppingRuleMetaJudge

    tiny = build_small_vlm(tmp_path / "tiny")
    rubrics: list[str] = []
    original = MPOModule.compute_rewards

    def recording(self, rollout):
        rubrics.append(self.rubric_state.rubric)
        assert isinstance(self.meta_backend, DroppingRuleMetaJudge)
        return original(self, rollout)

    monkeypatch.setattr(MPOModule, "compute_rewards", recording)
    MODEL_REWARDS.clear()
    config = REPO / "configs" / "vlm" / "mpo_hacking_tiny.yaml"
    overrides = ["--model.init_args.mpo_interval=1", f"--model.init_args.mpo_rubric_dir={tmp_path / 'rubrics'}"]
    assert main(tiny_grpo_fit_args(config, tiny, tmp_path, *overrides)) == 0
    (metrics_file,) = tmp_path.glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("rewards/total/mean")]
    assert len(logged) == 2 and [float(row["rewards/judge/mean"]) for row in logged] == [0.0, 0.0]
    assert [float(row["mpo/rubric_items"]) for row in logged] == [5.0, 5.0]
    assert [rubric_items(r) for r in rubrics] == [rubric_items(HACKING_RUBRIC)] * 2
