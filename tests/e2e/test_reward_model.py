"""A reward-model checkpoint as a reward (``rm:PATH``, mmpo.rewards.reward_model): its scores are the model's own
forward on each (prompt, completion) in its chat template, batched or not; they are weighted with the other
rewards and logged under rewards/rm_<name>/*; bad specs fail before anything loads; `mmpo build-tiny --kind
reward` builds one; configs/vlm/grpo_tiny_reward_model.yaml trains 2 steps through `mmpo fit` with it."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tiny_vlm_support import tiny_grpo_fit_args

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.rewards import compute_rewards
from mmpo.rewards.reward_model import reward_model
from mmpo.rewards.user import RewardSpecError, validate_reward_weights
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"problem": "What is 2+2?", "answer": "4"}, {"problem": "What is 10-3?", "answer": "7"},
        {"problem": "Count the shapes.", "answer": "3"}]
TEXTS = ["<think>2 and 2</think><answer>4</answer>", "<answer>8</answer>", "I think three, so 3."]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("rm") / "tiny_rm"
    assert main(["build-tiny", "--kind", "reward", "--out", str(out), "--hidden-size", "32",
                 "--intermediate-size", "64", "--vocab-size", "400"]) == 0
    return str(out)


def test_scores_are_the_models_forward_in_its_chat_template(rm_path):
    spec = f"rm:{rm_path}?batch_size=2"  # batches of 2 and 1: padding must not change a score
    scores = reward_model(spec)(TEXTS, ROWS)
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    expected = []
    for text, row in zip(TEXTS, ROWS):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": row["problem"]},
                                                  {"role": "assistant", "content": text}], tokenize=False)
        assert row["problem"] in rendered and text in rendered
        ids = tokenizer(rendered, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            expected.append(float(model(**ids).logits[0, 0]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3  # a random head still tells the texts apart


def test_reward_model_scores_join_the_weighted_sum_and_the_logs(rm_path):
    spec = f"rm:{rm_path}"
    total, per_fn, metrics = compute_rewards({spec: 0.5, "accuracy": 1.0}, TEXTS, ROWS, timeout_s=10.0)
    scores = torch.tensor(reward_model(spec)(TEXTS, ROWS))
    torch.testing.assert_close(per_fn[spec], scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(total, 0.5 * scores + torch.tensor([1.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    label = "rm_" + Path(rm_path).name
    assert metrics[f"rewards/{label}/mean"] == pytest.approx(float(scores.mean()), abs=1e-6)
    assert metrics[f"rewards/{label}/errors"] == 0.0 and metrics[f"rewards/{label}/timeouts"] == 0.0
    assert reward_model(spec) is reward_model(spec)  # loaded once per process


def test_bad_reward_model_specs_fail_before_loading(rm_path, tmp_path):
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    cases = {
        f"rm:{tmp_path / 'missing'}": "config.json not found",
        f"rm:{tmp_path / 'lm'}": "not an AutoModelForSequenceClassification checkpoint",
        f"rm:{rm_path}?device=cpu&colour=red": r"unknown option\(s\) \['colour'\]",
        f"rm:{rm_path}?dtype=int8": "dtype must be one of",
        f"rm:{rm_path}?batch_size=0": "batch_size must be >= 1",
        "rm:": "no checkpoint path",
    }
    for spec, message in cases.items():
        with pytest.raises(RewardSpecError, match=message):
            validate_reward_weights({spec: 1.0})


def test_grpo_tiny_reward_model_config_trains_two_steps(rm_path, tmp_path, monkeypatch):
    tiny = build_tiny_vlm(tmp_path / "tiny", corpus=[SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)],
                          vocab_size=400, hidden_size=64, intermediate_size=128)
    args = tiny_grpo_fit_args(REPO / "configs" / "vlm" / "grpo_tiny_reward_model.yaml", str(tiny), tmp_path,
                              f'--model.init_args.rewards.weights={{"accuracy": 0.9, "format": 0.1, '
                              f'"rm:{rm_path}?batch_size=32": 0.5}}')
    assert main(args) == 0
    (path,) = tmp_path.glob("**/metrics.csv")
    label = "rm_" + Path(rm_path).name
    rows = [r for r in csv.DictReader(path.open()) if r.get(f"rewards/{label}/mean")]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row[f"rewards/{label}/mean"])) and float(row[f"rewards/{label}/errors"]) == 0.0


def test_docs_rewards_python_example_runs(rm_path, tmp_path, monkeypatch):
    """docs/rewards.md's Python block, run as written from a directory where runs/tiny/reward_model exists."""
    import re
    import shutil

    block = re.search(r"```python\n(.*?)```", (REPO / "docs" / "rewards.md").read_text(), re.S).group(1)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    shutil.copytree(rm_path, tmp_path / "runs" / "tiny" / "reward_model")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "docs/rewards.md", "exec"), namespace)
    scores = reward_model(f"rm:{tmp_path / 'runs' / 'tiny' / 'reward_model'}")(namespace["texts"], namespace["rows"])
    expected = torch.tensor([1.0, 0.0]) + 0.5 * torch.tensor(scores)
    torch.testing.assert_close(namespace["total"], expected, atol=1e-6, rtol=0)
    assert namespace["metrics"]["rewards/rm_reward_model/mean"] == pytest.approx(sum(scores) / 2, abs=1e-6)
