"""The ``codebook_pair`` task (mmpo.data.synthetic.agent_tasks): the codes of two keys joined, hand-checked items
and traces (one call per key, a redundant repeat in about half of them), key-level split of the held-out items,
and keys and answers that pre-tokenise into single characters."""

from __future__ import annotations

import re

from mmpo.data.synthetic import AGENT_TASKS, make_items
from mmpo.data.synthetic.agent_tasks import CODEBOOK_PAIR_REPEAT, codebook_key_split, codebook_pair_trace
from mmpo.rewards.builtin import accuracy_values, format_values
from mmpo.tools.codebook import codebook
from mmpo.tools.parsing import HermesToolCallParser, ToolCall


def _calls(trace):
    return [call for message in trace if message["role"] == "assistant"
            for call in HermesToolCallParser().parse(message["content"])]


def _keys(rows):
    return {key for row in rows for key in re.findall(r'"(\w+)"', row["problem"])}


def test_key_split_is_the_hash_bucket_by_hand():
    # sha256("codebook-split:b7k")[:8] = 42bb18810917b882 -> 62 (train, 0-79);
    # sha256("codebook-split:c2m")[:8] = 3d34b86ced9fecce -> 98, "d4u": 7886bb4612c036db -> 99 (test, 90-99)
    assert int("42bb18810917b882", 16) % 100 == 62 and int("3d34b86ced9fecce", 16) % 100 == 98
    assert int("7886bb4612c036db", 16) % 100 == 99
    assert [codebook_key_split(key) for key in ("b7k", "c2m", "d4u")] == ["train", "test", "test"]


def test_trace_calls_each_key_and_repeats_the_chosen_one():
    # code_of("b7k") = D8, code_of("q0z") = S5 (tests/tools/test_codebook.py)
    plain = codebook_pair_trace(("b7k", "q0z"))
    assert [m["role"] for m in plain] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert _calls(plain) == [ToolCall("codebook", {"key": "b7k"}), ToolCall("codebook", {"key": "q0z"})]
    assert [m["content"] for m in plain if m["role"] == "tool"] == ["D8", "S5"]
    assert plain[-1]["content"] == "<think>I read the codes.</think><answer>D8S5</answer>"
    first, second = codebook_pair_trace(("b7k", "q0z"), 0), codebook_pair_trace(("b7k", "q0z"), 1)
    assert [c.arguments["key"] for c in _calls(first)] == ["b7k", "b7k", "q0z"]
    assert [c.arguments["key"] for c in _calls(second)] == ["b7k", "q0z", "q0z"]
    assert [m["content"] for m in first if m["role"] == "tool"] == ["D8", "D8", "S5"]
    assert first[-1] == second[-1] == plain[-1]


def test_rows_by_hand_and_their_traces_solve_them():
    assert "codebook_pair" in AGENT_TASKS
    rows = make_items("codebook_pair", 40, seed=1234, split="test")
    # the first held-out rows (generated with seed 1234): c2m -> R1, d4u -> Y6; c2m is looked up twice
    assert rows[0]["problem"] == 'Join the codes of "c2m" and "d4u".' and rows[0]["answer"] == "R1Y6"
    assert [c.arguments["key"] for c in _calls(rows[0]["tool_trace"])] == ["c2m", "c2m", "d4u"]
    assert [(row["problem"], row["answer"]) for row in rows[2:4]] == [
        ('Join the codes of "b5d" and "z1u".', "F1Y4"), ('Join the codes of "k4e" and "r7x".', "T9H1")]
    for row in rows:
        first, second = re.findall(r'"(\w+)"', row["problem"])
        calls = _calls(row["tool_trace"])
        assert first != second and {c.arguments["key"] for c in calls} == {first, second}
        assert len(calls) in (2, 3)  # one call per key, plus a repeat in some traces
        responses = [m["content"] for m in row["tool_trace"] if m["role"] == "tool"]
        assert responses == [codebook(**c.arguments) for c in calls]
        assert row["answer"] == codebook(first) + codebook(second)
    finals = [row["tool_trace"][-1]["content"] for row in rows]
    assert accuracy_values(finals, rows) == [1.0] * 40 and format_values(finals, rows) == [1.0] * 40
    assert accuracy_values(["<think>x</think><answer>R1Y7</answer>"], rows[:1]) == [0.0]


def test_about_half_the_traces_repeat_a_lookup():
    rows = make_items("codebook_pair", 600, seed=0, split="train")
    repeats = [len(_calls(row["tool_trace"])) == 3 for row in rows]
    assert CODEBOOK_PAIR_REPEAT == 0.5 and 0.44 < sum(repeats) / len(rows) < 0.56  # binomial sd 0.02


def test_held_out_keys_never_appear_in_training():
    train = make_items("codebook_pair", 2000, seed=0, split="train")
    test = make_items("codebook_pair", 100, seed=1234, split="test")
    val = make_items("codebook_pair", 50, seed=0, split="val")
    assert len(_keys(test)) > 100 and not _keys(train) & _keys(test) and not _keys(val) & (_keys(train) | _keys(test))
    assert {codebook_key_split(key) for key in _keys(test)} == {"test"}
    assert {codebook_key_split(key) for key in _keys(train)} == {"train"}


def test_keys_and_the_joined_answer_pretokenise_into_single_characters():
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    pieces = [piece for piece, _ in split('Join the codes of "c2m" and "d4u".')]
    assert pieces[-11:] == ['Ġ"', "c", "2", "m", '"', "Ġand", 'Ġ"', "d", "4", "u", '".']
    answer = [piece for piece, _ in split("<answer>R1Y6</answer>")]
    assert answer[answer.index(">") + 1:][:5] == ["R", "1", "Y", "6", "</"]
