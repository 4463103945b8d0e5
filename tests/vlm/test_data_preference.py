"""Preference pairs: synthetic chosen / rejected, local files with column overrides, the DataModule."""

import json
import random

import pytest
from PIL import Image

from mmpo.data.datamodule import PreferenceDataModule
from mmpo.data.loaders import ColumnKeys
from mmpo.data.preference import load_preference_rows, synthetic_preference_row, wrong_answer, wrong_solution
from mmpo.data.schema import BadRowError
from mmpo.rewards import compute_rewards


def _row(**fields):
    return {"id": "r0", "problem": "What is 3 + 6?", "answer": "9", "steps": ["3 + 6 = 9.", "So the answer is 9."],
            **fields}


def test_wrong_answers_by_kind():
    rng = random.Random(0)
    assert {wrong_answer(_row(answer="1"), rng) for _ in range(50)} == {"0", "2", "3"}  # 1 - 2 < 0 is left out
    position = _row(problem="Is the red shape left or right of the blue shape?", answer="right")
    assert wrong_answer(position, rng) == "left"
    size = _row(problem="Which shape is bigger, the red one or the blue one?", answer="blue")
    assert wrong_answer(size, rng) == "red"
    assert wrong_answer(_row(answer="B", choices=["x", "y"]), rng) == "A"
    with pytest.raises(ValueError, match="cannot make a wrong answer for 'triangle'"):
        wrong_answer(_row(problem="Name the shape.", answer="triangle"), rng)


def test_wrong_solution_changes_the_conclusion_only():
    angle = _row(answer="40", steps=["The two angles are 80 and 60.", "80 + 60 = 140.", "180 - 140 = 40."])
    # "140" keeps its digits; only the final "40" becomes the wrong answer
    assert wrong_solution(angle, "41") == ("<think>The two angles are 80 and 60. 80 + 60 = 140. 180 - 140 = 41."
                                           "</think><answer>41</answer>")
    no_answer_in_last = _row(steps=["3 + 6 = 9."], answer="9")
    assert wrong_solution({**no_answer_in_last, "steps": ["Add them."]}, "8") == (
        "<think>Add them. So the answer is 8.</think><answer>8</answer>")


def test_synthetic_pairs_are_deterministic_and_scored_right():
    row = _row()
    pair = synthetic_preference_row(row, seed=3)
    assert pair == synthetic_preference_row(row, seed=3)
    assert pair["chosen"] == "<think>3 + 6 = 9. So the answer is 9.</think><answer>9</answer>"
    _, per_fn, _ = compute_rewards({"accuracy": 1.0, "format": 1.0}, [pair["chosen"], pair["rejected"]], [row, row],
                                   timeout_s=None)
    assert per_fn["accuracy"].tolist() == [1.0, 0.0]  # chosen correct, rejected wrong
    assert per_fn["format"].tolist() == [1.0, 1.0]  # both well-formed: the pair differs in correctness only


def test_load_preference_file_with_overrides(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    records = [
        {"uid": "p1", "question": "<image>Which colour?", "img": "a.png", "good": "red", "bad": "blue"},
        # TRL's conversational form: the last assistant turn's text
        {"uid": "p2", "question": "Say hi.", "img": None, "bad": [{"role": "assistant", "content": "bye"}],
         "good": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    keys = ColumnKeys(prompt_key="question", image_key="img", system_prompt="Be brief.")
    rows, stats = load_preference_rows(path, keys=keys, chosen_key="good", rejected_key="bad")
    assert stats == {"total": 2, "loaded": 2, "skipped": 0, "errors": []}
    assert [(r["id"], r["problem"], r["chosen"], r["rejected"], len(r["images"])) for r in rows] == [
        ("p1", "Which colour?", "red", "blue", 1), ("p2", "Say hi.", "hi", "bye", 0)]
    assert rows[0]["system_prompt"] == "Be brief." and "answer" not in rows[0]
    with pytest.raises(BadRowError, match=r"row 0 \(id='p1'\): no column 'chosen'.*'bad', 'good'"):
        load_preference_rows(path, keys=keys)
    path.write_text(json.dumps({**records[0], "good": ""}) + "\n" + json.dumps(records[1]))
    rows, stats = load_preference_rows(path, keys=keys, chosen_key="good", rejected_key="bad", skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["p2"] and stats["skipped"] == 1 and "column 'good'" in stats["errors"][0]


def test_datamodule_pairs_train_rows_only(tmp_path):
    dm = PreferenceDataModule(tasks=["arithmetic", "bar_chart"], train_size=4, val_size=2, batch_size=2, seed=0)
    dm.setup("fit")
    assert all(row["chosen"] != row["rejected"] for row in dm.train_rows)
    assert all(row["chosen"] == f"<think>{' '.join(row['steps'])}</think><answer>{row['answer']}</answer>"
               for row in dm.train_rows)
    assert all("chosen" not in row for row in dm.val_rows)
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 2 and {"chosen", "rejected"} <= set(batch[0])
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "f1", "prompt": "Hi?", "chosen": "yes", "rejected": "no"}))
    with_file = PreferenceDataModule(tasks=[], data_path=str(path), batch_size=1, val_size=0)
    with_file.setup("fit")
    assert [(r["chosen"], r["rejected"]) for r in with_file.train_rows] == [("yes", "no")]
