"""The abstaining SFT teacher of the quickstart (mmpo.data.demonstrations): which rows it changes, how, and
that no reward counts its answer correct."""

import hashlib
import re

import pytest

from mmpo.data import render_solution
from mmpo.data.demonstrations import (
    ABSTAIN_ANSWER,
    AbstainingTeacherDataModule,
    abstains,
    abstention_rate,
    asked_colour,
    with_abstentions,
)
from mmpo.data.synthetic import make_items
from mmpo.rewards import accuracy_reward


def _row(item_id: str, problem: str, answer: str = "3") -> dict:
    return {"id": item_id, "problem": problem, "answer": answer, "steps": ["one.", "two."], "images": []}


def test_asked_colour_is_the_first_colour_word():
    assert asked_colour("How many red shapes are in the image?") == "red"
    assert asked_colour("Which shape is bigger, the orange one or the blue one?") == "orange"
    assert asked_colour("What is 12 + 7?") is None
    assert asked_colour("How many reddish shapes?") is None  # whole words only


def test_share_one_and_zero_select_exactly_the_colour_rule():
    rows = [_row("a", "How many red shapes?"), _row("b", "How many purple shapes?"),
            _row("c", "What is the value of the green bar?"), _row("d", "What is 2 + 2?")]
    assert [abstains(r, ("red", "green"), 1.0, seed=0) for r in rows] == [True, False, True, False]
    assert [abstains(r, ("red", "green"), 0.0, seed=0) for r in rows] == [False] * 4


def test_the_draw_is_the_sha256_of_seed_and_id():
    # the documented rule, recomputed here: draw = first 8 bytes of sha256("abstain:<seed>:<id>") / 2**64
    draws = {i: int.from_bytes(hashlib.sha256(f"abstain:7:{i}".encode()).digest()[:8], "big") / 2**64
             for i in ("x0", "x1", "x2", "x3", "x4", "x5")}
    share = sorted(draws.values())[2] + 1e-12  # exactly the three smallest draws fall below it
    picked = {i for i in draws if abstains(_row(i, "How many blue shapes?"), ("blue",), share, seed=7)}
    assert picked == set(sorted(draws, key=draws.get)[:3])


def test_with_abstentions_replaces_the_solution_and_leaves_the_input_alone():
    rows = [_row("a", "How many red shapes?"), _row("b", "How many purple shapes?")]
    out = with_abstentions(rows, ("red",), 1.0, seed=0)
    assert render_solution(out[0]) == "<think>I am not sure.</think><answer>unsure</answer>"
    assert out[0]["abstained"] is True and out[0]["id"] == "a" and out[0]["problem"] == rows[0]["problem"]
    assert out[1] == rows[1]
    assert rows[0]["answer"] == "3" and rows[0]["steps"] == ["one.", "two."]


@pytest.mark.parametrize("colours, share, message", [(("pink",), 0.5, "unknown abstain colour"),
                                                     (("red",), 1.5, "must be in [0, 1]")])
def test_bad_settings_fail_in_one_line(colours, share, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        with_abstentions([], colours, share, seed=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        AbstainingTeacherDataModule(abstain_colours=colours, abstain_share=share, tasks=["count_shapes"])


def test_abstention_rate_counts_the_abstaining_answers():
    texts = ["<think>I am not sure.</think><answer>unsure</answer>", "<think>x</think><answer>3</answer>",
             "<answer>unsure</answer>", "unsure"]
    assert abstention_rate(texts) == 0.5
    assert abstention_rate([]) == 0.0


def test_the_datamodule_changes_training_rows_only():
    kwargs = dict(tasks=["count_shapes", "bar_chart"], train_size=40, val_size=10, test_size=10, seed=3)
    plain = AbstainingTeacherDataModule(abstain_share=0.0, **kwargs)
    teacher = AbstainingTeacherDataModule(abstain_colours=("red", "blue", "green"), abstain_share=1.0, **kwargs)
    plain.setup("fit"), teacher.setup("fit")
    expected = [asked_colour(r["problem"]) in ("red", "blue", "green") for r in plain.train_rows]
    assert [r["answer"] == ABSTAIN_ANSWER for r in teacher.train_rows] == expected
    assert 0 < sum(expected) < len(expected)
    for mine, theirs in zip(teacher.train_rows, plain.train_rows):
        if mine["answer"] != ABSTAIN_ANSWER:
            assert mine["answer"] == theirs["answer"] and mine["steps"] == theirs["steps"]
    for split in ("val_rows", "test_rows"):
        assert [r["answer"] for r in getattr(teacher, split)] == [r["answer"] for r in getattr(plain, split)]


def test_no_task_counts_the_abstention_correct():
    rows = [row for task in ("count_shapes", "compare_size", "bar_chart") for row in make_items(task, 5, seed=0)]
    completion = "<think>I am not sure.</think><answer>unsure</answer>"
    assert accuracy_reward([completion] * len(rows), rows).tolist() == [0.0] * len(rows)


def test_the_config_in_docs_data_builds_the_teacher():
    import importlib
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if "AbstainingTeacherDataModule" in b)
    spec = yaml.safe_load(block)["data"]
    module_name, class_name = spec["class_path"].rsplit(".", 1)
    datamodule = getattr(importlib.import_module(module_name), class_name)(
        **spec["init_args"], train_size=20, val_size=0, seed=0)
    datamodule.setup("fit")
    expected = [asked_colour(r["problem"]) in ("red", "blue", "green") and
                int.from_bytes(hashlib.sha256(f"abstain:0:{r['id']}".encode()).digest()[:8], "big") / 2**64 < 0.8
                for r in AbstainingTeacherDataModule(abstain_share=0.0, tasks=["count_shapes", "bar_chart"],
                                                     train_size=20, val_size=0, seed=0)._synthetic(20, "train")]
    assert [r["answer"] == ABSTAIN_ANSWER for r in datamodule.train_rows] == expected and any(expected)


def test_the_teacher_reads_the_asked_colour_of_a_text_row():
    """The text task ``inventory`` puts its question first, so the colour rule reads the asked colour, not the
    first colour listed after it."""
    goran = _row("t0", "How many orange coins does Goran have? Goran has 13 red coins, 15 blue coins and 8 orange "
                 "coins.", answer="8")
    dara = _row("t1", "How many red stamps does Dara have? Dara has 16 red stamps and 8 blue stamps.", answer="16")
    assert (asked_colour(goran["problem"]), asked_colour(dara["problem"])) == ("orange", "red")
    assert [abstains(r, ("red", "blue", "green"), 1.0, seed=0) for r in (goran, dara)] == [False, True]
    out = with_abstentions([goran, dara], ("red", "blue", "green"), 1.0, seed=0)
    assert out[0] == goran and render_solution(out[1]) == "<think>I am not sure.</think><answer>unsure</answer>"


def test_the_datamodule_applies_the_rule_to_text_rows():
    kwargs = dict(tasks=["inventory"], train_size=60, val_size=10, test_size=10, seed=1)
    plain = AbstainingTeacherDataModule(abstain_share=0.0, **kwargs)
    teacher = AbstainingTeacherDataModule(abstain_colours=("red", "blue", "green"), abstain_share=0.8, **kwargs)
    plain.setup("fit"), teacher.setup("fit")
    asked = [re.match(r"How many (\w+) ", r["problem"]).group(1) for r in plain.train_rows]
    draws = [int.from_bytes(hashlib.sha256(f"abstain:1:{r['id']}".encode()).digest()[:8], "big") / 2**64
             for r in plain.train_rows]
    expected = [colour in ("red", "blue", "green") and draw < 0.8 for colour, draw in zip(asked, draws)]
    assert [r["answer"] == ABSTAIN_ANSWER for r in teacher.train_rows] == expected
    assert 0 < sum(expected) < len(expected)
    assert [r["answer"] for r in teacher.val_rows] == [r["answer"] for r in plain.val_rows]
    rows = make_items("inventory", 30, seed=0)
    assert accuracy_reward(["<think>I am not sure.</think><answer>unsure</answer>"] * 30, rows).tolist() == [0.0] * 30
