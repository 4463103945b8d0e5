"""Data modules: arithmetic splits and JSONL trace files."""

from __future__ import annotations

import json

import pytest

from mmpo.dllm.data import ArithmeticDataModule, TraceFileDataModule


def test_arithmetic_batches_are_row_lists():
    data = ArithmeticDataModule(train_size=40, test_size=10, val_size=5, batch_size=8, val_batch_size=5)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert len(batch) == 8 and {"id", "problem", "trace", "answer"} <= set(batch[0])
    assert sum(len(b) for b in data.val_dataloader()) == 5
    with pytest.raises(ValueError, match="val_size"):
        ArithmeticDataModule(test_size=4, val_size=5)


def test_trace_file_rows_and_a_bad_row_named(tmp_path):
    good = tmp_path / "train.jsonl"
    good.write_text("\n".join(json.dumps({"problem": f"{i}+1", "trace": f"{i}+1={i + 1}\nA:{i + 1}", "answer": i + 1})
                              for i in range(4)) + "\n")
    data = TraceFileDataModule(str(good), str(good), batch_size=2)
    data.setup()
    assert data.train_rows[0]["answer"] == "1" and data.train_rows[0]["id"].endswith(":1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: row is missing \['trace'\]"):
        TraceFileDataModule.read(str(bad))
