"""Synthetic tasks: determinism, split disjointness, schema, images, difficulty, solutions."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from mmpo.data import ROW_FIELDS, STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT, render_solution, validate_row
from mmpo.data.synthetic import TASKS, VISUAL_TASKS, corpus, make_items, register_task
from mmpo.data.synthetic.drawing import COLORS, PATCH
from mmpo.data.synthetic.registry import SPLIT_BUCKETS, content_bucket

BUILTIN = list(VISUAL_TASKS) + ["arithmetic"]


def _fingerprint(row):
    return (row["problem"], row["answer"], tuple(im.tobytes() for im in row["images"]))


@pytest.mark.parametrize("task", BUILTIN)
def test_same_seed_same_items_other_seed_other_items(task):
    a = make_items(task, 9, seed=3)
    b = make_items(task, 9, seed=3)
    c = make_items(task, 9, seed=4)
    assert [_fingerprint(r) for r in a] == [_fingerprint(r) for r in b]
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [_fingerprint(r) for r in a] != [_fingerprint(r) for r in c]


@pytest.mark.parametrize("task", BUILTIN)
def test_splits_never_share_an_item(task):
    train = {_fingerprint(r) for r in make_items(task, 60, seed=0, split="train")}
    val = {_fingerprint(r) for r in make_items(task, 20, seed=0, split="val")}
    test = {_fingerprint(r) for r in make_items(task, 20, seed=1, split="test")}
    assert not train & val and not train & test and not val & test
    for split in SPLIT_BUCKETS:
        for row in make_items(task, 5, seed=2, split=split):
            assert content_bucket(row) in SPLIT_BUCKETS[split]


@pytest.mark.parametrize("task", BUILTIN)
def test_every_row_field_present_and_valid(task):
    rows = make_items(task, 6, seed=0)
    assert len({r["id"] for r in rows}) == 6
    for index, row in enumerate(rows):
        assert set(ROW_FIELDS) <= set(row)
        validate_row(row, index)
        assert row["task"] == task
        assert row["expert_trace"] == render_solution(row)
        assert 1 <= len(row["steps"]) <= 3 and row["answer"]
        assert "<image>" not in row["problem"]


@pytest.mark.parametrize("task", VISUAL_TASKS)
def test_images_are_rgb_at_requested_size_and_needed(task):
    for size in (56, 84):
        for row in make_items(task, 3, seed=0, image_size=size):
            assert row["needs_image"] is True
            assert len(row["images"]) == 1
            assert row["images"][0].mode == "RGB" and row["images"][0].size == (size, size)


def test_text_task_has_no_image_and_does_not_need_one():
    row = make_items("arithmetic", 1, seed=0, difficulty=1)[0]
    assert row["images"] == [] and row["needs_image"] is False
    a, b = (int(t) for t in row["problem"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert int(row["answer"]) == a + b


@pytest.mark.parametrize("task", BUILTIN)
def test_difficulty_fixed_or_cycled(task):
    assert {r["difficulty"] for r in make_items(task, 4, seed=0, difficulty=2)} == {2}
    assert [r["difficulty"] for r in make_items(task, 6, seed=0)] == [1, 2, 3, 1, 2, 3]


def test_difficulty_scales_objects_and_values():
    # count_shapes: level 1 asks for 1..3 shapes, level 3 for 2..7.
    assert {int(r["answer"]) for r in make_items("count_shapes", 30, seed=0, difficulty=1)} <= {1, 2, 3}
    assert max(int(r["answer"]) for r in make_items("count_shapes", 30, seed=0, difficulty=3)) > 3
    # bar_chart: 2 bars at level 1, 4 bars at level 3 (stated in the first step).
    assert {r["steps"][0] for r in make_items("bar_chart", 5, seed=0, difficulty=1)} == {"There are 2 bars."}
    assert {r["steps"][0] for r in make_items("bar_chart", 5, seed=0, difficulty=3)} == {"There are 4 bars."}
    # relative_position: vertical questions appear only at level 3.
    assert all("left or right" in r["problem"] for r in make_items("relative_position", 20, seed=0, difficulty=1))
    assert any("above or below" in r["problem"] for r in make_items("relative_position", 20, seed=0, difficulty=3))


@pytest.mark.parametrize("task", BUILTIN)
def test_key_steps_appear_in_steps(task):
    for row in make_items(task, 9, seed=5):
        text = " ".join(row["steps"]).lower()
        assert row["key_steps"], row["id"]
        for group in row["key_steps"]:
            assert group[0].lower() in text, (row["id"], group)


def _color_cells(image: Image.Image, rgb) -> set[tuple[int, int]]:
    """Grid cells (14 px) holding at least 4 pixels of exactly ``rgb``."""
    counts: dict[tuple[int, int], int] = {}
    pixels = image.load()
    for y in range(image.height):
        for x in range(image.width):
            if pixels[x, y] == rgb:
                cell = (x // PATCH, y // PATCH)
                counts[cell] = counts.get(cell, 0) + 1
    return {cell for cell, n in counts.items() if n >= 4}


def test_count_shapes_answer_matches_the_pixels():
    for row in make_items("count_shapes", 12, seed=1):
        color = row["problem"].split()[2]  # "How many <color> shapes ..."
        assert len(_color_cells(row["images"][0], COLORS[color])) == int(row["answer"]), row["id"]


def test_relative_position_answer_matches_the_pixels():
    for row in make_items("relative_position", 12, seed=1):
        words = row["problem"].split()
        first, second = words[2], words[-2]
        (c1, r1), = _color_cells(row["images"][0], COLORS[first])
        (c2, r2), = _color_cells(row["images"][0], COLORS[second])
        expected = {"left": c1 < c2, "right": c1 > c2, "above": r1 < r2, "below": r1 > r2}
        assert expected[row["answer"]], row["id"]


def test_shape_position_answer_matches_the_pixels():
    for row in make_items("shape_position", 12, seed=1):
        (col, line), = _color_cells(row["images"][0], COLORS[row["problem"].split()[2]])
        # 4 x 4 grid: cells 0-1 are the left / top half, 2-3 the right / bottom half
        expected = {"left": col < 2, "right": col >= 2, "top": line < 2, "bottom": line >= 2}
        assert expected[row["answer"]], row["id"]
    singles = make_items("shape_position", 6, seed=0, difficulty=1)
    assert all(len(_color_cells(r["images"][0], c)) <= 1 for r in singles for c in COLORS.values())


def test_bar_chart_answer_matches_bar_height():
    # Level 1: values 1..4 over 56 - 6 = 50 px, so one unit is 12.5 px.
    for row in make_items("bar_chart", 8, seed=1, difficulty=1):
        color = COLORS[row["problem"].split()[6]]  # "What is the value of the <color> bar?"
        image = row["images"][0]
        heights = [sum(image.getpixel((x, y)) == color for y in range(56)) for x in range(56)]
        assert round(max(heights) / 12.5) == int(row["answer"]), row["id"]


def test_triangle_angle_answer_is_180_minus_the_two_angles():
    for row in make_items("triangle_angle", 9, seed=0):
        a, b = (int(t) for t in row["steps"][0].removeprefix("The two angles are ").rstrip(".").split(" and "))
        assert int(row["answer"]) == 180 - a - b > 0


def test_compare_size_answer_is_the_colour_with_more_pixels():
    for row in make_items("compare_size", 9, seed=0, difficulty=1):
        words = row["problem"].rstrip("?").split()
        first, second = words[5], words[-2]  # "Which shape is bigger, the <a> one or the <b> one?"
        image = row["images"][0]
        area = {c: sum(p == COLORS[c] for p in image.getdata()) for c in (first, second)}
        assert max(area, key=area.get) == row["answer"], row["id"]


def test_render_solution_both_styles_exact():
    row = {"images": [], "answer": "7", "steps": ["3 + 4 = 7.", "So the answer is 7."],
           "image_description": "No picture.", "rationale": "Add."}
    assert render_solution(row) == "<think>3 + 4 = 7. So the answer is 7.</think><answer>7</answer>"
    assert render_solution(row, style="steps") == (
        "### Image Description: No picture.\n"
        "### Rationales: Add.\n"
        "### Step 1: 3 + 4 = 7.\n"
        "### Step 2: So the answer is 7.\n"
        "### The final answer is: 7"
    )
    with pytest.raises(ValueError, match="unknown solution style"):
        render_solution(row, style="markdown")


def test_register_task_adds_a_task_and_rejects_duplicates():
    name = "unit_test_constant_task"

    def constant(rng: random.Random, difficulty: int, image_size: int) -> dict:
        value = rng.randint(0, 10**9)
        return {"images": [Image.new("RGB", (image_size, image_size))], "problem": f"Echo {value}?",
                "answer": str(value), "steps": [f"It is {value}."], "key_steps": [[str(value)]],
                "needs_image": True}

    register_task(name)(constant)
    try:
        rows = make_items(name, 3, seed=0, split="test")
        assert [r["task"] for r in rows] == [name] * 3
        with pytest.raises(ValueError, match="already registered"):
            register_task(name)(constant)
    finally:
        from mmpo.data.synthetic import registry

        registry._GENERATORS.pop(name)
        registry.TASKS.remove(name)


def test_unknown_task_and_bad_arguments_are_named():
    with pytest.raises(KeyError, match="count_shapes"):
        make_items("no_such_task", 1, seed=0)
    with pytest.raises(ValueError, match="split"):
        make_items("count_shapes", 1, seed=0, split="dev")
    with pytest.raises(ValueError, match="difficulty"):
        make_items("count_shapes", 1, seed=0, difficulty=4)


def test_corpus_covers_prompts_problems_and_both_solution_styles():
    texts = corpus(["count_shapes", "bar_chart"], n=4, seed=0)
    assert texts == corpus(["count_shapes", "bar_chart"], n=4, seed=0)
    assert SYSTEM_PROMPT in texts and STEPS_SYSTEM_PROMPT in texts
    row = make_items("bar_chart", 4, seed=0, split="test")[3]
    assert row["problem"] in texts
    assert render_solution(row) in texts and render_solution(row, "steps") in texts
    assert set(TASKS) >= set(BUILTIN)
