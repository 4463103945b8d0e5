"""`mmpo fit` with rewards from models: configs/vlm/grpo_tiny_reward_model.yaml (a reward-model checkpoint)
and configs/vlm/grpo_tiny_judge.yaml (a generative judge behind an OpenAI-compatible server on the loopback
address, started here) train 2 steps, and the logged rewards are exactly what the models give the sampled
completions."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from loopback_judge import LoopbackJudge

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.rewards import accuracy_reward, format_reward
from mmpo.rewards.models import MODEL_REWARDS, judge_prompt
from mmpo.vlm.factory import build_tiny_reward_model, build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
TASKS = ["count_shapes", "arithmetic"]


def _fit(config: Path, model: str, tmp_path: Path, models: dict, monkeypatch) -> list[tuple[list[str], list[dict]]]:
    from mmpo.algos.grpo import GRPOModule

    seen: list[tuple[list[str], list[dict]]] = []
    original = GRPOModule.compute_rewards

    def recording(self, rollout):
        seen.append((list(rollout.texts), [dict(row) for row in rollout.rows]))
        return original(self, rollout)

    monkeypatch.setattr(GRPOModule, "compute_rewards", recording)
    MODEL_REWARDS.clear()
    assert main([
        "fit", "-c", str(config), f"--model.init_args.model_path={model}", "--model.init_args.output_dir=null",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=6",
        f"--model.init_args.rewards.models={json.dumps(models)}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}", f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        f"--data.init_args.tasks=[{','.join(TASKS)}]", "--data.init_args.train_size=4",
        "--data.init_args.batch_size=2",
    ]) == 0
    return seen


def _logged(tmp_path: Path) -> list[dict]:
    (metrics_file,) = (tmp_path / "run").glob("**/metrics.csv")
    return [row for row in csv.DictReader(metrics_file.open()) if row.get("rewards/total/mean")]


def _config_models(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["model"]["init_args"]["rewards"]["models"]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), corpus=[SYSTEM_PROMPT, *corpus(TASKS, n=20)],
                              vocab_size=400, hidden_size=64, intermediate_size=128))


def test_grpo_trains_two_steps_with_a_reward_model(tiny_vlm, tmp_path, monkeypatch):
    config = REPO / "configs" / "vlm" / "grpo_tiny_reward_model.yaml"
    rm_path = str(build_tiny_reward_model(tmp_path / "rm", corpus=[SYSTEM_PROMPT, *corpus(TASKS, n=20)]))
    models = _config_models(config)
    models["helpful_rm"]["path"] = rm_path
    seen = _fit(config, tiny_vlm, tmp_path, models, monkeypatch)
    logged = _logged(tmp_path)
    assert len(seen) == len(logged) == 2

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    for (texts, rows), metrics in zip(seen, logged):
        scores = []
        for text, row in zip(texts, rows):  # the reward model by hand, one unpadded chat at a time
            chat = tokenizer.apply_chat_template([{"role": "user", "content": row["problem"]},
                                                  {"role": "assistant", "content": text}], tokenize=False)
            with torch.no_grad():
                scores.append(float(rm(**tokenizer(chat, return_tensors="pt", add_special_tokens=False)).logits[0, 0]))
        totals = [0.9 * float(accuracy_reward([t], [r])[0]) + 0.1 * float(format_reward([t], [r])[0]) + 0.5 * s
                  for t, r, s in zip(texts, rows, scores)]
        assert float(metrics["rewards/helpful_rm/mean"]) == pytest.approx(sum(scores) / len(scores), abs=1e-5)
        assert float(metrics["rewards/total/mean"]) == pytest.approx(sum(totals) / len(totals), abs=1e-5)
        assert float(metrics["rewards/helpful_rm/errors"]) == 0.0


def _length_judge() -> LoopbackJudge:
    """An OpenAI-compatible judge on 127.0.0.1: replies 'Score: n' with n = len(user text) % 11, except
    for prompts whose length is divisible by 5, which get a reply without a score."""
    return LoopbackJudge(lambda text: "undecided" if len(text) % 5 == 0 else f"Score: {len(text) % 11}")


def test_grpo_trains_two_steps_with_an_http_judge(tiny_vlm, tmp_path, monkeypatch):
    config = REPO / "configs" / "vlm" / "grpo_tiny_judge.yaml"
    server = _length_judge()
    try:
        models = _config_models(config)
        models["judge"]["url"] = server.url
        seen = _fit(config, tiny_vlm, tmp_path, models, monkeypatch)
    finally:
        server.close()
    logged = _logged(tmp_path)
    assert len(seen) == len(logged) == 2
    rubric = models["judge"]["rubric"]
    for (texts, rows), metrics in zip(seen, logged):
        prompts = [judge_prompt(rubric, row["problem"], text, row) for text, row in zip(texts, rows)]
        scores = [None if len(p) % 5 == 0 else (len(p) % 11) / 10 for p in prompts]
        applicable = [s for s in scores if s is not None]
        expected = sum(applicable) / len(applicable) if applicable else float("nan")
        assert float(metrics["rewards/judge/mean"]) == pytest.approx(expected, abs=1e-6, nan_ok=True)
        assert float(metrics["rewards/judge/unparseable"]) == sum(s is None for s in scores)
        assert float(metrics["rewards/judge/failed"]) == 0.0
        totals = [0.9 * float(accuracy_reward([t], [r])[0]) + 0.1 * float(format_reward([t], [r])[0])
                  + (0.5 * s if s is not None else 0.0) for t, r, s in zip(texts, rows, scores)]
        assert float(metrics["rewards/total/mean"]) == pytest.approx(sum(totals) / len(totals), abs=1e-6)
    assert set(server.prompts) >= {judge_prompt(rubric, r["problem"], t, r) for t, r in zip(*seen[0])}
