"""`mmpo fit -c configs/vlm/grpo_tiny_user_reward.yaml`: GRPO trains with reward functions from
examples/rewards.py given as `file.py:fn`, fed the dataset's `answer` and `difficulty` columns, and
logs exactly what those functions give the sampled completions."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import pytest

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.rewards import accuracy_reward, format_reward
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "grpo_tiny_user_reward.yaml"
WEIGHTS = {"accuracy": 0.8, "format": 0.1, "answer_mentioned": 0.3, "brevity_when_easy": 0.2}  # as in CONFIG


def _expected_rewards(texts: list[str], rows: list[dict]) -> list[dict[str, float | None]]:
    """The four rewards of CONFIG per completion: the example's answer_mentioned called directly with
    TRL's convention and the `answer` column, brevity_when_easy written out from its docstring."""
    mentioned = _example_module().answer_mentioned(
        prompts=[row["problem"] for row in rows], completions=texts, answer=[row["answer"] for row in rows])
    return [{
        "accuracy": float(accuracy_reward([text], [row])[0]),
        "format": float(format_reward([text], [row])[0]),
        "answer_mentioned": score,
        "brevity_when_easy": 1.0 / (1 + len(text.split())) if row["difficulty"] == 1 else None,
    } for text, row, score in zip(texts, rows, mentioned)]


def _example_module():
    spec = importlib.util.spec_from_file_location("examples_rewards_under_test", REPO / "examples" / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_trains_with_user_rewards_from_examples(tmp_path, monkeypatch):
    model = build_tiny_vlm(tmp_path / "tiny", corpus=[SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)],
                           vocab_size=400, hidden_size=64, intermediate_size=128)
    from mmpo.algos.grpo import GRPOModule

    seen: list[tuple[list[str], list[dict]]] = []
    original = GRPOModule.compute_rewards

    def recording(self, rollout):
        seen.append((list(rollout.texts), [dict(row) for row in rollout.rows]))
        return original(self, rollout)

    monkeypatch.setattr(GRPOModule, "compute_rewards", recording)
    monkeypatch.chdir(REPO)  # the config names examples/rewards.py relative to the repository root
    assert main([
        "fit", "-c", str(CONFIG), f"--model.init_args.model_path={model}", "--model.init_args.output_dir=null",
        "--model.init_args.sampling.num_generations=4", "--model.init_args.sampling.max_new_tokens=6",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}", f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--data.init_args.tasks=[count_shapes,arithmetic]", "--data.init_args.train_size=8",
        "--data.init_args.batch_size=4",
    ]) == 0

    (metrics_file,) = (tmp_path / "run").glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(metrics_file.open()) if row.get("rewards/total/mean")]
    assert len(seen) == len(logged) == 2  # one rollout per optimizer step
    applicable = skipped = 0
    for (texts, rows), metrics in zip(seen, logged):
        hand = _expected_rewards(texts, rows)
        totals = [sum(WEIGHTS[name] * value for name, value in h.items() if value is not None) for h in hand]
        assert float(metrics["rewards/total/mean"]) == pytest.approx(sum(totals) / len(totals), abs=1e-6)
        for name in ("answer_mentioned", "brevity_when_easy"):
            values = [h[name] for h in hand if h[name] is not None]
            expected = sum(values) / len(values) if values else math.nan
            assert float(metrics[f"rewards/{name}/mean"]) == pytest.approx(expected, abs=1e-6, nan_ok=True), name
            assert float(metrics[f"rewards/{name}/none_frac"]) == pytest.approx(1 - len(values) / len(hand))
            assert float(metrics[f"rewards/{name}/errors"]) == 0.0
        applicable += sum(h["brevity_when_easy"] is not None for h in hand)
        skipped += sum(h["brevity_when_easy"] is None for h in hand)
    # the run exercised both sides of the `difficulty` column: easy rows scored, the others None
    assert applicable > 0 and skipped > 0
