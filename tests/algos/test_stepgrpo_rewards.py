"""StepGRPO rewards (R1-VL, arXiv 2503.12937): StepRAR and StepRVR rules, hand-computed."""

from __future__ import annotations

import pytest
import torch

from mmpo.rewards import get_reward
from mmpo.rewards.step import (
    extract_final_answer,
    is_valid_step_format,
    key_step_match_fraction,
    step_rar,
    step_rvr,
)

ROW = {
    "id": "tri-1",
    "answer": "45",
    # three key-step groups; the first has two equivalent spellings
    "key_steps": [["angle a = 60", "a=60"], ["180 - 60 - 75"], ["triangle"]],
}

VALID_CORRECT = (
    "### Image Description: A triangle ABC.\n"
    "### Rationales: Use the angle sum.\n"
    "### Step 1: Angle A = 60 degrees.\n"
    "### Step 2: 180 - 60 - 75 = 45.\n"
    "### The final answer is: 45"
)
WRONG_ANSWER = (
    "### Image Description: A triangle.\n### Rationales: Guess.\n"
    "### Step 1: a=60.\n### The final answer is: 50"
)
NO_ANSWER = "### Image Description: x\n### Rationales: y\n### Step 1: A=60 and 180 - 60 - 75\n"


def test_key_steps_are_searched_in_step_sections_only_case_insensitively():
    # "triangle" appears only in the Image Description, so it does not count: k = 2 / 3
    assert key_step_match_fraction(VALID_CORRECT, ROW["key_steps"]) == pytest.approx(2 / 3)
    # an equivalent spelling of a group counts once
    assert key_step_match_fraction("### Step 1: A=60 a=60", ROW["key_steps"]) == pytest.approx(1 / 3)
    assert key_step_match_fraction(VALID_CORRECT, []) == 0.0


def test_step_rar_hand_computed():
    rows = [ROW, ROW, ROW]
    rewards = step_rar([VALID_CORRECT, WRONG_ANSWER, NO_ANSWER], rows)
    # correct + 0.1 * 2/3 = 1.066667; wrong + 0.1 * 1/3 = 0.033333; no answer (code default) 0.1 * 2/3
    assert rewards.tolist() == pytest.approx([1.0 + 0.1 * 2 / 3, 0.1 / 3, 0.1 * 2 / 3])
    strict = step_rar([VALID_CORRECT, WRONG_ANSWER, NO_ANSWER], rows, no_answer_zero=True)
    assert strict.tolist() == pytest.approx([1.0 + 0.1 * 2 / 3, 0.1 / 3, 0.0])
    assert step_rar([VALID_CORRECT], [ROW], alpha=0.5).tolist() == pytest.approx([1.0 + 0.5 * 2 / 3])


def test_step_rar_missing_key_steps_error_or_skip():
    bare = {"id": "no-keys-7", "answer": "45", "key_steps": []}
    with pytest.raises(ValueError, match="no-keys-7"):
        step_rar([VALID_CORRECT], [bare])
    assert step_rar([VALID_CORRECT], [bare], on_missing_key_steps="skip").tolist() == [1.0]


def test_final_answer_extraction():
    assert extract_final_answer(VALID_CORRECT) == "45"
    assert extract_final_answer("### The final answer is:\n  12 \nmore") == "12"
    assert extract_final_answer("### The final answer is:   ") is None
    assert extract_final_answer(NO_ANSWER) is None


@pytest.mark.parametrize(
    "text,valid",
    [
        (VALID_CORRECT, True),
        # missing Rationales header
        ("### Image Description: x\n### Step 1: a\n### The final answer is: 1", False),
        # steps skip a number
        ("### Image Description: x\n### Rationales: r\n### Step 1: a\n### Step 3: b\n### The final answer is: 1", False),
        # steps out of order
        ("### Image Description: x\n### Rationales: r\n### Step 1: a\n### Step 2: b\n### Step 1: c\n"
         "### The final answer is: 1", False),
        # final answer before the last step
        ("### Image Description: x\n### Rationales: r\n### Step 1: a\n### The final answer is: 1\n### Step 2: b", False),
        # no step at all
        ("### Image Description: x\n### Rationales: r\n### The final answer is: 1", False),
        # missing final answer header
        ("### Image Description: x\n### Rationales: r\n### Step 1: a", False),
    ],
)
def test_step_rvr_rules(text, valid):
    assert is_valid_step_format(text) is valid
    assert step_rvr([text], [ROW]).tolist() == [float(valid)]


def test_registered_and_summed():
    completions = [VALID_CORRECT, WRONG_ANSWER]
    rows = [ROW, ROW]
    total = get_reward("step_rar")(completions, rows) + get_reward("step_rvr")(completions, rows)
    # valid + correct: 1 + 0.0667 + 1; wrong answer, valid format: 0.0333 + 1
    assert total.tolist() == pytest.approx([2.0 + 0.1 * 2 / 3, 1.0 + 0.1 / 3])
    assert total.dtype == torch.float32


def test_registered_step_rar_variants_pickle_to_the_reward_worker():
    """Each registered StepRAR variant survives pickling (so it runs in the reward worker under its deadline,
    not in the trainer), keeps its registered name, and scores as its options say."""
    import pickle

    import mmpo.rewards.step  # noqa: F401  (registers the variants)
    from mmpo.rewards import get_reward

    for name, options in {"step_rar": {}, "step_rar_no_answer_zero": {"no_answer_zero": True},
                          "step_rar_skip_missing": {"on_missing_key_steps": "skip"},
                          "step_rar_no_answer_zero_skip_missing": {"no_answer_zero": True,
                                                                   "on_missing_key_steps": "skip"}}.items():
        registered = get_reward(name)
        copy = pickle.loads(pickle.dumps(registered))
        assert copy == registered and copy.__name__ == name
        rows = [{"answer": "4", "key_steps": [["2+2"]]}, {"answer": "4", "key_steps": [["2+2"]]}]
        texts = ["<think>2+2</think><answer>4</answer>", "<think>no</think>"]
        expected = step_rar(texts, rows, **options)
        assert torch.equal(copy(texts, rows), expected)
