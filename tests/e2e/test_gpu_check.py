"""bench/gpu_check.py: a clear exit (status 2) without CUDA, and its whole pipeline at tiny widths on CPU."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_exits_2(monkeypatch, capsys):
    gpu_check = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_cpu_pipeline_prints_the_table(tmp_path, capsys):
    gpu_check = _load()
    out = tmp_path / "table.md"
    assert gpu_check.main(["--tiny-cpu", "--steps", "1", "--prompts", "2", "--generations", "2",
                           "--max-new-tokens", "4", "--micro-batch-size", "2", "--workdir", str(tmp_path / "w"),
                           "--out", str(out)]) == 0
    table = out.read_text()
    assert table in capsys.readouterr().out
    assert "vocabulary 151,936" in table and "| 1 |" in table
    ratio = float(re.search(r"\| estimate / measured \| ([0-9.]+) \|", table).group(1))
    assert 0.75 <= ratio <= 1.25  # the budget holds at the real vocabulary size too
    # the model really has the real vocabulary and the tiny tokenizer's special ids
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "w" / "model")
    assert config.text_config.vocab_size == 151936 and config.image_token_id == 5
