"""The calc task's tool tokenizer: one token per digit everywhere (``individual_digits``), so a calc prompt's
numbers, the calculator call's argument and the tool's result are the same digit tokens; without it, byte-level BPE
cuts the same number differently in the prompt, the call and the result (why the calc SFT start could not copy)."""

from __future__ import annotations

import json
import re

import pytest

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import (QWEN_TEXT_CHAT_TEMPLATE, QWEN_TEXT_SPECIAL_TOKENS, _train_tokenizer,
                              build_tiny_text_lm, tool_task_corpus)


@pytest.fixture(scope="module")
def corpus():
    return tool_task_corpus("calc", ["calculator"], n=60)


def _tokenizer(corpus, individual_digits):
    return _train_tokenizer(corpus, 1024, special_tokens=QWEN_TEXT_SPECIAL_TOKENS,
                            chat_template=QWEN_TEXT_CHAT_TEMPLATE, individual_digits=individual_digits)


def _digit_ids(tokenizer, text):
    """The ids of ``text``'s tokens that hold a digit, and those tokens' strings."""
    pieces = tokenizer.tokenize(text)
    ids = tokenizer.convert_tokens_to_ids(pieces)
    held = [(i, p) for i, p in zip(ids, pieces) if re.search(r"\d", p)]
    return [i for i, _ in held], [p for _, p in held]


def _numbers(row):
    """The prompt's operands, the call's expression, the tool's result and the final answer of a calc row."""
    call, result, final = row["tool_trace"]
    expression = json.loads(call["content"].split("\n")[1])["arguments"]["expression"]
    answer = re.search(r"<answer>(.*)</answer>", final["content"]).group(1)
    return row["problem"], call["content"], expression, result["content"], answer


def test_every_digit_is_one_token_and_numbers_match_across_prompt_call_and_result(corpus):
    tokenizer = _tokenizer(corpus, individual_digits=True)
    digit_ids = tokenizer.convert_tokens_to_ids(list("0123456789"))
    assert len(set(digit_ids)) == 10 and tokenizer.unk_token_id not in digit_ids
    for row in make_items("calc", 12, seed=3, split="test"):  # held-out rows: not in the tokenizer's corpus
        problem, call, expression, result, answer = _numbers(row)
        assert expression in problem and result == answer == row["answer"]
        prompt_ids, prompt_pieces = _digit_ids(tokenizer, problem)
        call_ids, call_pieces = _digit_ids(tokenizer, call)
        result_ids, _ = _digit_ids(tokenizer, result)
        answer_ids, _ = _digit_ids(tokenizer, row["tool_trace"][2]["content"].split("<answer>")[1])
        # one token per digit, each the digit itself
        assert prompt_pieces == re.findall(r"\d", problem) and call_pieces == re.findall(r"\d", expression)
        # the same digit ids in the prompt, the call's argument, the tool's result and the answer
        assert prompt_ids == call_ids == [digit_ids[int(d)] for d in re.findall(r"\d", expression)]
        assert result_ids == answer_ids == [digit_ids[int(d)] for d in re.findall(r"\d", result)]
        # and the whole conversation round-trips through the chat template
        text = tokenizer.apply_chat_template([{"role": "user", "content": problem}, *row["tool_trace"]],
                                             tokenize=False)
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_without_individual_digits_the_same_number_is_cut_differently(corpus):
    """The failure the option fixes: byte-level BPE merges digits, and a number after a space (the prompt) and
    after a quote (the call) becomes different tokens."""
    tokenizer = _tokenizer(corpus, individual_digits=False)
    differ = 0
    for row in make_items("calc", 12, seed=3, split="test"):
        problem, call, *_ = _numbers(row)
        prompt_ids, pieces = _digit_ids(tokenizer, problem)
        call_ids, _ = _digit_ids(tokenizer, call)
        assert len(pieces) < len(re.findall(r"\d", problem))  # merged digits
        differ += prompt_ids != call_ids
    assert differ > 0


def test_build_tiny_text_lm_keeps_individual_digits_when_loaded(tmp_path, corpus):
    from transformers import AutoTokenizer

    path = build_tiny_text_lm(tmp_path / "lm", vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                              corpus=corpus, individual_digits=True)
    assert json.loads((path / "mmpo_tiny.json").read_text())["individual_digits"] is True
    tokenizer = AutoTokenizer.from_pretrained(path)
    pieces = tokenizer.tokenize('"expression": "9018 * 470 + 93962"')
    assert [p for p in pieces if re.search(r"\d", p)] == list("901847093962")
