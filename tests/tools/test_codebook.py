"""The codebook tool and the ``codebook`` task (mmpo.tools.codebook, mmpo.data.synthetic.agent_tasks): hand values
of the hash codes, the rows' traces, disjoint keys across splits, and keys that pre-tokenise the same in the prompt
and in the call."""

from __future__ import annotations

import json
import random

import pytest

from mmpo.data.synthetic import make_items
from mmpo.data.synthetic.agent_tasks import codebook_key
from mmpo.rewards.builtin import accuracy_values, format_values
from mmpo.tools.codebook import code_of, codebook
from mmpo.tools.functions import load_tools
from mmpo.tools.parsing import HermesToolCallParser, ToolCall


def test_codes_are_the_hash_by_hand():
    # sha256("codebook:b7k")[:8] = c53dde735a42c262, sha256("codebook:q0z")[:8] = 2019cb321469e5a1 (hashlib)
    n, m = int("c53dde735a42c262", 16), int("2019cb321469e5a1", 16)
    assert (n // 10 % 26, n % 10) == (3, 8) and (m // 10 % 26, m % 10) == (18, 5)  # D8, S5
    assert code_of("b7k") == "D8" and codebook("b7k") == "D8"
    assert codebook(" q0z ") == "S5"  # the key is stripped
    codes = {code_of(codebook_key(random.Random(i))) for i in range(200)}
    assert all(len(c) == 2 and c[0].isupper() and c[1].isdigit() for c in codes) and len(codes) > 100
    with pytest.raises(ValueError, match="key must not be empty"):
        codebook("  ")


def test_codebook_is_a_builtin_tool_with_a_one_string_schema():
    (tool,) = load_tools(["codebook"])
    function = tool.schema["function"]
    assert tool.name == function["name"] == "codebook"
    assert function["parameters"]["required"] == ["key"]
    assert function["parameters"]["properties"]["key"]["type"] == "string"


def test_keys_are_letter_digit_letter():
    rng = random.Random(3)
    assert [codebook_key(rng) for _ in range(3)] == ["h9r", "e5t", "p9c"]


def test_rows_carry_the_trace_that_solves_them():
    rows = make_items("codebook", 6, seed=0, split="test")
    assert [(row["problem"], row["answer"]) for row in rows[:3]] == [
        ('What is the code of "n6m"?', "Y9"), ('What is the code of "a3z"?', "J8"), ('What is the code of "k2i"?', "C4")]
    call, response, answer = rows[0]["tool_trace"]
    assert HermesToolCallParser().parse(call["content"]) == [ToolCall("codebook", {"key": "n6m"})]
    assert response == {"role": "tool", "content": "Y9"}
    assert answer["content"] == "<think>I read the code.</think><answer>Y9</answer>"
    for row in rows:
        (parsed,) = HermesToolCallParser().parse(row["tool_trace"][0]["content"])
        assert codebook(**parsed.arguments) == row["tool_trace"][1]["content"] == row["answer"]
    finals = [row["tool_trace"][2]["content"] for row in rows]
    assert accuracy_values(finals, rows) == [1.0] * 6 and format_values(finals, rows) == [1.0] * 6


def test_splits_hold_disjoint_keys():
    train = {row["problem"] for row in make_items("codebook", 600, seed=0, split="train")}
    test = {row["problem"] for row in make_items("codebook", 100, seed=1234, split="test")}
    assert len(test) > 50 and not train & test


def test_keys_and_codes_pretokenise_into_single_characters():
    """Byte-level BPE (the tiny text LM's pre-tokenizer) merges only inside a pre-token: alternating letters and
    digits make every character of a key or code its own pre-token, so its own token, in the prompt, the call,
    the tool answer and the final answer alike."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    row = make_items("codebook", 1, seed=0, split="test")[0]
    prompt = [piece for piece, _ in split(row["problem"])]
    call = [piece for piece, _ in split(row["tool_trace"][0]["content"])]
    assert prompt[-5:] == ['Ġ"', "n", "6", "m", '"?']
    assert call[call.index("key") + 3:call.index("key") + 6] == ["n", "6", "m"]
    answer = [piece for piece, _ in split(row["tool_trace"][2]["content"])]
    assert answer[answer.index(">", answer.index("answer")) + 1:][:3] == ["Y", "9", "</"]


def test_tool_task_corpus_holds_the_tool_prompt_and_traces():
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.tools.functions import tool_system_prompt
    from mmpo.vlm.factory import (QWEN_TEXT_CHAT_TEMPLATE, QWEN_TEXT_SPECIAL_TOKENS, TOOL_PROMPT_REPEATS,
                                  _train_tokenizer, default_text_corpus, tool_task_corpus)

    texts = tool_task_corpus("codebook", ["codebook"], n=20)
    system = tool_system_prompt(SYSTEM_PROMPT, [load_tools(["codebook"])[0].schema])
    default = default_text_corpus()
    assert texts[:len(default)] == default and texts.count(system) == TOOL_PROMPT_REPEATS
    rows = make_items("codebook", 20, seed=0, split="train")
    assert texts[len(default) + TOOL_PROMPT_REPEATS:][:20] == [row["problem"] for row in rows]
    assert len(texts) == len(default) + TOOL_PROMPT_REPEATS + 20 + 3 * 20  # call, tool answer, final answer
    tokenizer = _train_tokenizer(texts, 1024, special_tokens=QWEN_TEXT_SPECIAL_TOKENS,
                                 chat_template=QWEN_TEXT_CHAT_TEMPLATE)
    call = rows[0]["tool_trace"][0]["content"]
    key = rows[0]["problem"].split('"')[1]
    pieces = tokenizer.tokenize(call)
    assert "codebook" in pieces and "arguments" in pieces  # whole words once the traces are in the corpus
    assert pieces[pieces.index("key") + 3:pieces.index("key") + 6] == list(key)  # one token per key character
