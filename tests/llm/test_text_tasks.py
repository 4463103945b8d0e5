"""The synthetic text tasks for text LMs (long_arithmetic, word_problem, countdown): answers the accuracy
reward (math-verify) checks, on hand examples and on generated items; the held-out split; DPO pairs."""

from __future__ import annotations

import re

import pytest

from mmpo.data.preference import synthetic_preference_row
from mmpo.data.synthetic import TASKS, TEXT_TASKS, TEXT_TEACHER_TASKS, make_items
from mmpo.rewards import accuracy_reward, format_reward
from mmpo.rewards.answers import row_answer_correct, uses_exactly


def _scores(row, answers):
    return accuracy_reward([f"<think>...</think><answer>{a}</answer>" for a in answers], [row] * len(answers)).tolist()


def test_text_tasks_are_registered():
    assert TEXT_TASKS == ("long_arithmetic", "word_problem", "countdown")
    assert TEXT_TEACHER_TASKS == ("inventory",)
    assert set(TEXT_TASKS) | set(TEXT_TEACHER_TASKS) <= set(TASKS)


def test_hand_example_inventory():
    row = {"answer": "8", "problem": "How many orange coins does Goran have? Goran has 13 red coins, 15 blue coins "
           "and 8 orange coins."}
    assert _scores(row, ["8", "8.0", "\\boxed{8}", "13", "15", "8 orange coins", "unsure"]) == [1, 1, 1, 0, 0, 0, 0]


def test_hand_examples_arithmetic_and_word_problem():
    row = {"answer": "-234", "problem": "Compute 206 - 644 + 204."}
    assert _scores(row, ["-234", "-234.0", "\\boxed{-234}", "234", "-233", ""]) == [1, 1, 1, 0, 0, 0]
    row = {"answer": "11", "problem": "Goran has 36 shells. ... How many shells does each friend get?"}
    assert _scores(row, ["11", "11 shells", "12"]) == [1, 0, 0]


def test_hand_examples_countdown():
    """Any expression using exactly 3, 5, 7 (once each) whose value math-verify finds equal to 22 is right."""
    row = {"answer": "3 * 5 + 7", "numbers": [3, 5, 7], "target": 22}
    answers = ["3 * 5 + 7", "7 + 5*3", "(5 * 3) + 7", "22", "3 * 5 + 7 + 0", "(3 + 5) * 7", "3 * 5 + 7 * 1",
               "3 * 5 + 7 = 22", "5 * 5 - 3"]
    assert _scores(row, answers) == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert uses_exactly("(12 - 4) * 7 - 12", [4, 7, 12, 12]) and not uses_exactly("12 - 4", [4, 12, 12])
    assert not uses_exactly("__import__('os')", [])
    assert not row_answer_correct(None, row)


def _check_generated(row):
    """The row's answer recomputed from its problem text, independently of the generator."""
    problem, answer = row["problem"], row["answer"]
    if row["task"] == "long_arithmetic":
        expression = re.fullmatch(r"Compute (.+)\.", problem).group(1)
        assert int(answer) == eval(expression, {"__builtins__": {}})  # digits and + - * only (checked below)
        assert set(expression) <= set("0123456789+-* ")
    elif row["task"] == "word_problem":
        count = int(re.search(r"has (\d+)", problem).group(1))
        packs, per_pack = map(int, re.search(r"buys (\d+) packs of (\d+)", problem).groups())
        count += packs * per_pack
        given = re.search(r"gives (\d+)", problem)
        count -= int(given.group(1)) if given else 0
        friends = re.search(r"among (\d+) friends", problem)
        if friends:
            assert count % int(friends.group(1)) == 0
            count //= int(friends.group(1))
        assert int(answer) == count
    elif row["task"] == "inventory":
        asked, item = re.fullmatch(r"How many (\w+) (\w+) does \w+ have\? .*", problem).groups()
        listed = re.findall(r"(\d+) (\w+) " + item, problem.split("? ", 1)[1])
        counts = {colour: int(count) for count, colour in listed}
        assert len(counts) == len(listed) == row["difficulty"] + 1 and len(set(counts.values())) == len(listed)
        assert int(answer) == counts[asked] and all(1 <= n <= 20 for n in counts.values())
    else:
        numbers = sorted(int(n) for n in re.search(r"numbers ([\d, ]+), each", problem).group(1).split(", "))
        target = int(re.search(r"make (-?\d+)\.", problem).group(1))
        assert row["numbers"] == numbers and row["target"] == target > 0
        assert uses_exactly(answer, numbers) and eval(answer, {"__builtins__": {}}) == target


@pytest.mark.parametrize("task", TEXT_TASKS + TEXT_TEACHER_TASKS)
def test_generated_answers_are_right_and_the_reference_solution_scores_one(task):
    rows = make_items(task, 30, seed=0)
    for row in rows:
        _check_generated(row)
        assert row["images"] == [] and row["needs_image"] is False
    traces = [row["expert_trace"] for row in rows]
    assert accuracy_reward(traces, rows).tolist() == [1.0] * 30
    assert format_reward(traces, rows).tolist() == [1.0] * 30
    # DPO pairs: the rejected solution ends in a wrong answer
    pairs = [synthetic_preference_row(row, seed=0) for row in rows]
    assert accuracy_reward([p["rejected"] for p in pairs], rows).tolist() == [0.0] * 30
    assert accuracy_reward([p["chosen"] for p in pairs], rows).tolist() == [1.0] * 30


@pytest.mark.parametrize("task", TEXT_TASKS + TEXT_TEACHER_TASKS)
def test_held_out_splits_are_disjoint_and_deterministic(task):
    splits = {split: make_items(task, 60, seed=0, split=split) for split in ("train", "val", "test")}
    problems = {split: {(r["problem"], r["answer"]) for r in rows} for split, rows in splits.items()}
    assert not problems["train"] & problems["val"] and not problems["train"] & problems["test"]
    assert not problems["val"] & problems["test"]
    assert [r["problem"] for r in make_items(task, 60, seed=0, split="test")] == [
        r["problem"] for r in splits["test"]]
    assert [r["difficulty"] for r in splits["train"][:6]] == [1, 2, 3, 1, 2, 3]
