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
    # sha256("codebook:bam")[:8] = 237d84ddf1339167, sha256("codebook:dit")[:8] = 79fd72d9b0b84bd7 (hashlib, by hand)
    assert int("237d84ddf1339167", 16) % 90 + 10 == 43 and int("79fd72d9b0b84bd7", 16) % 90 + 10 == 45
    assert code_of("bam") == 43 and codebook("bam") == "43"
    assert codebook(" dit ") == "45"  # the key is stripped
    assert all(10 <= code_of(codebook_key(random.Random(i), 2)) <= 99 for i in range(50))
    with pytest.raises(ValueError, match="key must not be empty"):
        codebook("  ")


def test_codebook_is_a_builtin_tool_with_a_one_string_schema():
    (tool,) = load_tools(["codebook"])
    function = tool.schema["function"]
    assert tool.name == function["name"] == "codebook"
    assert function["parameters"]["required"] == ["key"]
    assert function["parameters"]["properties"]["key"]["type"] == "string"


def test_keys_by_difficulty():
    rng = random.Random(3)
    assert [codebook_key(rng, s) for s in (1, 2, 3)] == ["gup", "firos", "rarazok"]  # consonant (vowel consonant)*


def test_rows_carry_the_trace_that_solves_them():
    rows = make_items("codebook", 6, seed=0, split="test")
    assert [len(row["problem"].split('"')[1]) for row in rows] == [3, 5, 7, 3, 5, 7]  # difficulty 1, 2, 3, ...
    first = rows[0]
    assert first["problem"] == 'What is the code of "dit"?' and first["answer"] == "45"
    call, response, answer = first["tool_trace"]
    assert HermesToolCallParser().parse(call["content"]) == [ToolCall("codebook", {"key": "dit"})]
    assert response == {"role": "tool", "content": "45"}
    assert answer["content"] == "<think>I read the code.</think><answer>45</answer>"
    for row in rows:
        (parsed,) = HermesToolCallParser().parse(row["tool_trace"][0]["content"])
        assert codebook(**parsed.arguments) == row["tool_trace"][1]["content"] == row["answer"]
    finals = [row["tool_trace"][2]["content"] for row in rows]
    assert accuracy_values(finals, rows) == [1.0] * 6 and format_values(finals, rows) == [1.0] * 6


def test_splits_hold_disjoint_keys():
    train = {row["problem"] for row in make_items("codebook", 600, seed=0, split="train")}
    test = {row["problem"] for row in make_items("codebook", 100, seed=1234, split="test")}
    assert len(test) > 50 and not train & test


def test_the_key_pretokenises_alike_in_the_prompt_and_the_call():
    """Byte-level BPE (the tiny text LM's pre-tokenizer) merges only inside a pre-token: the key is the same
    pre-token after the prompt's quote and after the call's quote, so it becomes the same tokens in both."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    row = make_items("codebook", 1, seed=0, split="test")[0]
    prompt = [piece for piece, _ in split(row["problem"])]
    call = [piece for piece, _ in split(row["tool_trace"][0]["content"])]
    assert prompt[-3:] == ['Ġ"', "dit", '"?'] and "dit" in call
    assert "45" in [piece for piece, _ in split(row["tool_trace"][2]["content"])]
