"""Rewards: answer extraction, accuracy (math-verify + word fallback), format, length."""

from __future__ import annotations

import threading

import pytest
import torch

from mmpo.data import render_solution
from mmpo.data.synthetic import make_items
from mmpo.rewards import REWARDS, extract_answer, get_reward, register_reward


def _rows(*answers):
    return [{"answer": a, "steps": [], "images": []} for a in answers]


def test_builtin_rewards_registered_and_unknown_name_lists_them():
    assert {"accuracy", "format", "length"} <= set(REWARDS)
    with pytest.raises(KeyError, match="accuracy"):
        get_reward("no_such_reward")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("accuracy")(lambda c, r: torch.zeros(len(c)))


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer> 3 </answer>", "3"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block wins
        ("<answer>so \\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("we get \\boxed{x^{2}} done", "x^{2}"),
        ("### Step 1: 3 + 4 = 7.\n### The final answer is: 7\n", "7"),
        ("I think it is 3", None),
        ("<answer>  </answer>", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("<think>x</think><answer>3</answer>", "3", 1.0),  # right
        ("<think>x</think><answer>4</answer>", "3", 0.0),  # wrong
        ("<think>the answer is 3</think>", "3", 0.0),  # missing answer
        ("", "3", 0.0),
        ("so it is \\boxed{3}", "3", 1.0),  # boxed
        ("<answer>\\sqrt{12}</answer>", "2\\sqrt{3}", 1.0),  # math-verify equivalence
        ("<answer>1/2</answer>", "0.5", 1.0),
        ("<answer>70^\\circ</answer>", "70", 1.0),
        ("<answer>2\\sqrt{3}</answer>", "2", 0.0),  # not read as "2"
        ("<answer>Left.</answer>", "left", 1.0),  # word answer, normalised
        ("<answer>\\text{left}</answer>", "left", 1.0),
        ("<answer>right</answer>", "left", 0.0),
        ("<answer>felt</answer>", "left", 0.0),  # math-verify alone would say l*e*f*t == f*e*l*t
        ("### The final answer is: red", "red", 1.0),  # StepGRPO layout
        ("<answer>(B)</answer>", "B", 1.0),  # choice letter in brackets
        ("<answer>(B)</answer>", "C", 0.0),
    ],
)
def test_accuracy_reward(completion, gold, reward):
    out = get_reward("accuracy")([completion], _rows(gold))
    assert out.dtype == torch.float32 and out.shape == (1,)
    assert out.item() == reward


def test_accuracy_on_synthetic_reference_solutions_is_one():
    rows = [r for task in ("count_shapes", "relative_position", "compare_size", "bar_chart", "triangle_angle")
            for r in make_items(task, 3, seed=0)]
    for style in ("think-answer", "steps"):
        completions = [render_solution(r, style) for r in rows]
        assert get_reward("accuracy")(completions, rows).tolist() == [1.0] * len(rows)


def test_accuracy_works_off_the_main_thread():
    # math-verify's signal timeouts fail off the main thread; ours must disable them there.
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("r", get_reward("accuracy")(["<answer>\\sqrt{12}</answer>"],
                                                                      _rows("2\\sqrt{3}"))))
    thread.start()
    thread.join(30)
    assert result["r"].tolist() == [1.0]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<think>a b</think><answer>3</answer>", 1.0),
        ("  <think>a</think>\n<answer>3</answer>\n", 1.0),  # whitespace around blocks is fine
        ("<answer>3</answer>", 0.0),  # no think block
        ("<think>a</think>", 0.0),  # no answer block
        ("<think>a</think><answer>3</answer> extra", 0.0),  # trailing text
        ("hi <think>a</think><answer>3</answer>", 0.0),  # leading text
        ("<think>a</think><answer> </answer>", 0.0),  # empty answer
        ("<think>a<think>b</think><answer>3</answer>", 0.0),  # nested tag
        ("<think>a</think><answer>3</answer><answer>4</answer>", 0.0),  # two answers
    ],
)
def test_format_reward(completion, reward):
    assert get_reward("format")([completion], _rows("3")).tolist() == [reward]


def test_length_reward_hand_computed():
    row = {"answer": "1", "steps": ["a b", "c"], "images": []}
    # reference "<think>a b c</think><answer>1</answer>" splits into 3 words
    assert len(render_solution(row).split()) == 3
    completions = ["x y z", "x y z w v u", "one", ""]
    # min(1, 3/3) = 1, min(1, 3/6) = 0.5, min(1, 3/1) = 1, empty -> 0
    assert get_reward("length")(completions, [row] * 4).tolist() == [1.0, 0.5, 1.0, 0.0]


def test_reward_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        get_reward("accuracy")(["a", "b"], _rows("3"))
