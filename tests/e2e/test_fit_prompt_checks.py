"""`mmpo fit` on a tiny dataset file with over-long prompts: they are named in one error before step 1, or
skipped and counted with `skip_bad_rows: true`; with `max_prompt_length: null` the model's context
(`max_position_embeddings` - `sampling.max_new_tokens`) still bounds them. Empty prompts name the row and key."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mmpo.cli import main
from mmpo.data import BadRowError, SYSTEM_PROMPT
from mmpo.data.loaders import load_rows
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.processing import encode_prompts
from mmpo.vlm.prompt_check import PromptLimit, model_context_length, prompt_limit

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "grpo_tiny.yaml"
CONTEXT = 256  # the tiny model's max_position_embeddings here


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=[SYSTEM_PROMPT, *corpus(["arithmetic"], n=20)],
                          vocab_size=400, hidden_size=64, intermediate_size=128, max_position_embeddings=CONTEXT)


def _dataset(path: Path) -> Path:
    rows = [{"id": f"short{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    rows.insert(1, {"id": "long1", "problem": "What is 1 + 1? " * 60, "answer": "2"})
    rows.insert(3, {"id": "long2", "problem": "What is 2 + 2? " * 80, "answer": "4"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _fit(tiny_path, tmp_path, *overrides):
    run = tmp_path / "run"
    return main([
        "fit", "-c", str(CONFIG), f"--model.init_args.model_path={tiny_path}", "--model.init_args.output_dir=null",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=16",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}", "--data.init_args.train_size=0",
        f"--data.init_args.data_path={_dataset(tmp_path / 'data.jsonl')}", "--data.init_args.batch_size=2",
        *overrides]), run


def _lengths(tiny_path, tmp_path):
    from mmpo.vlm.factory import load_vlm

    _, processor = load_vlm(str(tiny_path))
    rows, _ = load_rows(str(_dataset(tmp_path / "measure.jsonl")))
    return [int(n) for n in encode_prompts(processor, list(rows))["attention_mask"].sum(-1)]


def test_prompt_limit_is_the_smaller_of_the_setting_and_the_context():
    assert prompt_limit(None, 2048, 64) == PromptLimit(1984, "the model's 2048 positions - max_new_tokens 64")
    assert prompt_limit(512, 2048, 64) == PromptLimit(512, "max_prompt_length 512")
    assert prompt_limit(4096, 2048, 64).tokens == 1984
    assert prompt_limit(None, None, 64) is None


def test_overlong_prompts_are_one_error_before_training(tiny_path, tmp_path):
    lengths = _lengths(tiny_path, tmp_path)
    assert lengths[1] > CONTEXT - 16 and lengths[3] > CONTEXT - 16 and max(lengths[i] for i in (0, 2, 4, 5)) < 100
    # max_prompt_length null: the context still bounds the prompts (256 - 16 = 240)
    with pytest.raises(ValueError) as caught:
        _fit(tiny_path, tmp_path, "--model.init_args.max_prompt_length=null")
    assert str(caught.value) == (
        f"2 training prompt(s) longer than 240 tokens (the model's {CONTEXT} positions - max_new_tokens 16): "
        f"row 1 (id 'long1'): {lengths[1]} tokens, row 3 (id 'long2'): {lengths[3]} tokens; raise "
        "max_prompt_length, lower max_pixels or set data skip_bad_rows: true")
    assert not list((tmp_path / "run").glob("**/metrics.csv"))  # no step ran


def test_overlong_prompts_are_skipped_and_counted_with_skip_bad_rows(tiny_path, tmp_path, caplog, monkeypatch):
    from mmpo.data.datamodule import PromptDataModule

    seen: list[list[str]] = []
    original = PromptDataModule.train_dataloader

    def recording(self):
        seen.append([row["id"] for row in self.train_rows])
        return original(self)

    monkeypatch.setattr(PromptDataModule, "train_dataloader", recording)
    with caplog.at_level("WARNING"):
        code, run = _fit(tiny_path, tmp_path, "--model.init_args.max_prompt_length=100",
                         "--data.init_args.skip_bad_rows=true")
    assert code == 0
    assert seen == [["short0", "short1", "short2", "short3"]]
    assert "skipped 2 of 6 training prompts longer than 100 tokens (max_prompt_length 100)" in caplog.text
    (metrics_file,) = run.glob("**/metrics.csv")
    assert len([r for r in csv.DictReader(metrics_file.open()) if r.get("losses/policy")]) == 2


def test_empty_prompt_names_the_row_and_the_key(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"id": "a", "question": "   ", "answer": "1"}) + "\n")
    with pytest.raises(BadRowError, match=r"row 0.*empty prompt: column 'question'"):
        load_rows(str(path))
