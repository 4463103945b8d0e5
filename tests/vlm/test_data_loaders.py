"""Loaders: jsonl / json / parquet / save_to_disk, Geometry3K / ViRL39K / R1-VL-10K schemas, bad rows."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from mmpo.data import BadRowError, render_solution
from mmpo.data.loaders import load_rows, save_rows_jsonl
from mmpo.data.synthetic import make_items


def _png(color=(255, 0, 0), size=(16, 12)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def image_dir(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for k, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        (folder / f"{k}.png").write_bytes(_png(color))
    (folder / "corrupt.png").write_bytes(b"not a png at all")
    return folder


def test_jsonl_geometry3k_style_with_relative_paths(tmp_path, image_dir):
    path = _write_jsonl(tmp_path / "geo.jsonl", [
        {"id": "g0", "images": ["imgs/0.png"], "problem": "<image>Find x.", "answer": "3"},
        {"id": "g1", "images": ["imgs/1.png", "imgs/2.png"], "problem": "Find y. <image><image>",
         "answer": "2\\sqrt{3}", "solution": "Step one.\nStep two."},
    ])
    rows, stats = load_rows(path)
    assert stats == {"total": 2, "loaded": 2, "skipped": 0, "errors": [], "schema": "geometry3k"}
    first, second = rows
    assert first["id"] == "g0" and first["problem"] == "Find x." and first["answer"] == "3"
    assert first["images"][0].getpixel((0, 0)) == (255, 0, 0) and first["images"][0].size == (16, 12)
    assert first["needs_image"] is True and first["steps"] == [] and first["expert_trace"] is None
    assert first["difficulty"] == 2 and first["key_steps"] == []
    assert second["problem"] == "Find y." and len(second["images"]) == 2
    assert second["steps"] == ["Step one.", "Step two."]
    assert second["expert_trace"] == render_solution(second)


def test_image_root_resolves_relative_paths(tmp_path, image_dir):
    data_dir = tmp_path / "elsewhere"
    data_dir.mkdir()
    path = _write_jsonl(data_dir / "d.jsonl", [{"id": "a", "images": ["0.png"], "problem": "Q?", "answer": "1"}])
    rows, _ = load_rows(path, image_root=image_dir)
    assert rows[0]["images"][0].getpixel((0, 0)) == (255, 0, 0)


def test_virl39k_style_boxed_answer_and_qid(tmp_path, image_dir):
    path = _write_jsonl(tmp_path / "virl.jsonl", [
        {"qid": "v7", "question": "<image>How many?", "answer": "\\boxed{5}", "image": ["imgs/0.png"],
         "category": "counting", "PassRate_7BTrained": 0.5},
    ])
    rows, _ = load_rows(path)
    assert rows[0]["id"] == "v7" and rows[0]["answer"] == "5" and rows[0]["problem"] == "How many?"


def test_r1vl_key_steps_layout(tmp_path, image_dir):
    key_steps = {"Image Description": ["triangle"], "Steps": ["angle sum", ["12/2 = 6", "frac{12}{2}=6"]]}
    path = _write_jsonl(tmp_path / "r1vl.jsonl", [
        {"id": "r0", "images": ["imgs/0.png"], "problem": "Q", "answer": "6", "key_steps": key_steps,
         "expert_trace": "<think>t</think><answer>6</answer>"},
        {"id": "r1", "images": ["imgs/0.png"], "problem": "Q", "answer": "6", "key_steps": json.dumps(key_steps)},
    ])
    rows, _ = load_rows(path)
    for row in rows:
        assert row["key_steps"] == [["angle sum"], ["12/2 = 6", "frac{12}{2}=6"]]
    assert rows[0]["expert_trace"] == "<think>t</think><answer>6</answer>"


def test_json_list_file_with_numeric_fields(tmp_path, image_dir):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"id": "j0", "images": [], "problem": "1+1?", "answer": "2"},
                                {"id": 7, "problem": "1-1?", "answer": 0, "difficulty": 3}]))
    rows, _ = load_rows(path)
    assert rows[0]["images"] == [] and rows[0]["needs_image"] is False
    assert rows[1]["id"] == "7" and rows[1]["answer"] == "0" and rows[1]["difficulty"] == 3


BAD_RECORDS = [
    ({"id": "ok", "images": ["imgs/0.png"], "problem": "Q", "answer": "1"}, None),
    ({"id": "no_file", "images": ["imgs/missing.png"], "problem": "Q", "answer": "1"}, "image file not found"),
    ({"id": "corrupt", "images": ["imgs/corrupt.png"], "problem": "Q", "answer": "1"}, "cannot read image"),
    ({"id": "no_answer", "images": ["imgs/0.png"], "problem": "Q", "answer": " "}, "empty answer"),
    ({"id": "no_problem", "images": ["imgs/0.png"], "answer": "1"}, "missing problem"),
]


@pytest.mark.parametrize("bad_index", [1, 2, 3, 4])
def test_bad_row_error_names_index_and_id(tmp_path, image_dir, bad_index):
    record, message = BAD_RECORDS[bad_index]
    path = _write_jsonl(tmp_path / "bad.jsonl", [BAD_RECORDS[0][0], record])
    with pytest.raises(BadRowError, match=f"row 1 \\(id='{record['id']}'\\).*{message}"):
        load_rows(path)


def test_skip_bad_rows_counts_them(tmp_path, image_dir):
    records = [r for r, _ in BAD_RECORDS] + [{"id": "ok", "images": [], "problem": "Q", "answer": "2"}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "{not json\n")
    rows, stats = load_rows(path, skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["ok"]
    # 4 bad records + a duplicate id + an unparsable line
    assert stats["total"] == 7 and stats["loaded"] == 1 and stats["skipped"] == 6
    assert any("duplicate id" in e for e in stats["errors"])
    assert any("invalid JSON" in e and "line 7" in e for e in stats["errors"])


def _hf_dataset(images):
    import datasets

    features = datasets.Features({
        "id": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
    })
    return datasets.Dataset.from_dict({
        "id": [f"h{k}" for k in range(len(images))],
        "images": [[{"bytes": b, "path": None}] for b in images],
        "problem": ["<image>What colour?"] * len(images),
        "answer": ["red"] * len(images),
    }, features=features)


def test_hf_save_to_disk_dataset_and_datasetdict(tmp_path):
    import datasets

    ds = _hf_dataset([_png(), _png((0, 0, 255))])
    ds.save_to_disk(str(tmp_path / "single"))
    rows, stats = load_rows(tmp_path / "single")
    assert [r["id"] for r in rows] == ["h0", "h1"] and stats["schema"] == "geometry3k"
    assert rows[1]["images"][0].getpixel((3, 3)) == (0, 0, 255)
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(tmp_path / "dict")[0]) == 2
    assert len(load_rows(tmp_path / "dict", split="test")[0]) == 1
    with pytest.raises(ValueError, match="splits"):
        load_rows(tmp_path / "dict", split="validation")


def test_parquet_with_hf_image_feature_and_corrupt_row(tmp_path):
    ds = _hf_dataset([_png(), b"garbage bytes", _png((0, 255, 0))])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(BadRowError, match="row 1 \\(id='h1'\\).*cannot read image"):
        load_rows(tmp_path / "d.parquet")
    rows, stats = load_rows(tmp_path / "d.parquet", skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["h0", "h2"] and stats["skipped"] == 1


def test_parquet_with_raw_bytes_column_and_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    table = pa.table({"question": ["Q1", "Q2"], "answer": ["1", "2"], "image": [_png(), _png((0, 0, 0))]})
    pq.write_table(table.slice(0, 1), folder / "train-0.parquet")
    pq.write_table(table.slice(1, 1), folder / "train-1.parquet")
    rows, _ = load_rows(folder)
    assert [r["answer"] for r in rows] == ["1", "2"]
    assert rows[1]["images"][0].getpixel((0, 0)) == (0, 0, 0)
    assert [r["id"] for r in rows] == ["pq-0", "pq-1"]  # ids made from the source name when absent


def test_save_rows_jsonl_roundtrip(tmp_path):
    original = make_items("count_shapes", 3, seed=0) + make_items("arithmetic", 2, seed=0)
    rows, stats = load_rows(save_rows_jsonl(original, tmp_path / "rows.jsonl"))
    assert stats["schema"] == "row" and stats["loaded"] == 5
    for a, b in zip(original, rows):
        for field in ("id", "task", "problem", "answer", "steps", "key_steps", "expert_trace", "difficulty",
                      "needs_image"):
            assert a[field] == b[field], field
        assert [im.tobytes() for im in a["images"]] == [im.tobytes() for im in b["images"]]


def test_unsupported_path_and_schema(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_rows(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="schema"):
        load_rows(tmp_path / "x.csv", schema="coco")


def test_bad_first_row_is_named_and_skippable(tmp_path):
    path = _write_jsonl(tmp_path / "first_bad.jsonl", [
        {"id": "broken", "answer": "1"},  # no problem column: the schema cannot be read from it
        {"id": "fine", "images": [], "problem": "Q", "answer": "1"},
    ])
    with pytest.raises(BadRowError, match="row 0 \\(id='broken'\\)"):
        load_rows(path)
    rows, stats = load_rows(path, skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["fine"] and stats["skipped"] == 1 and stats["schema"] == "geometry3k"
