"""Continuation from a partial completion (mmpo.vlm.continuation): hand-worked padding, and the
invariant that makes it sound: scoring suffix tokens with the prefix moved into the prompt gives the
log-probs they have inside the full completion."""

from __future__ import annotations

import pytest
import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.continuation import continue_rollout, ended, extend_prompts, join_completions
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


def test_extend_prompts_repacks_left_padding():
    inputs = {"input_ids": torch.tensor([[0, 11, 12], [21, 22, 23]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
              "mm_token_type_ids": torch.tensor([[0, 1, 0], [0, 0, 0]]), "image_counts": torch.tensor([1, 0])}
    out = extend_prompts(inputs, torch.tensor([[31, 0], [41, 42]]), torch.tensor([[1, 0], [1, 1]]), pad_token_id=0)
    # [pad, 11, 12] + [31] -> [pad, pad, 11, 12, 31]; [21, 22, 23] + [41, 42] -> [21, 22, 23, 41, 42]
    assert out["input_ids"].tolist() == [[0, 0, 11, 12, 31], [21, 22, 23, 41, 42]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert out["mm_token_type_ids"].tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert out["image_counts"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="extend_prompts"):
        extend_prompts(inputs, torch.tensor([[31]]), torch.tensor([[1]]), pad_token_id=0)


def test_join_completions_by_hand():
    ids, mask = join_completions(torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]),
                                 torch.tensor([[4, 0], [5, 6]]), torch.tensor([[1, 0], [1, 1]]), pad_token_id=0)
    assert ids.tolist() == [[1, 2, 4], [3, 5, 6]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350)
    return load_vlm(path)


def test_suffix_log_probs_match_inside_the_full_completion(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    model.generation_config.suppress_tokens = [engine.eos_token_id, *engine.forbidden_ids]  # full-length rows
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)
    torch.manual_seed(0)
    full = engine.generate(rows, num_samples=2, max_new_tokens=6)
    k = 2
    prefix_mask = torch.zeros_like(full.completion_mask)
    prefix_mask[:, :k] = 1
    prompts = extend_prompts(full.prompt_inputs, full.completion_ids, prefix_mask, pad_token_id=engine.pad_token_id)
    suffix_ids, suffix_mask = full.completion_ids[:, k:], full.completion_mask[:, k:]
    with torch.no_grad():
        whole, _ = completion_log_probs(model, full.prompt_inputs, full.completion_ids, full.completion_mask)
        suffix, _ = completion_log_probs(model, prompts, suffix_ids, suffix_mask)
    torch.testing.assert_close(suffix, whole[:, k:], atol=1e-5, rtol=1e-5)


def test_continue_rollout_keeps_rows_and_groups(tiny):
    model, processor = tiny
    engine = HFGenerateEngine(model, processor)
    model.generation_config.suppress_tokens = [engine.eos_token_id, *engine.forbidden_ids]
    rows = make_items("count_shapes", 2, seed=0)
    torch.manual_seed(1)
    base = engine.generate(rows, num_samples=2, max_new_tokens=3)
    more = continue_rollout(engine, base, [3, 0, 0], max_new_tokens=4)
    assert more.group_ids.tolist() == [1, 0, 0]
    assert [r["id"] for r in more.rows] == [rows[1]["id"], rows[0]["id"], rows[0]["id"]]
    assert more.completion_ids.shape == (3, 4)
    # the new prompts end with the continued completion's tokens
    assert more.prompt_inputs["input_ids"][0, -3:].tolist() == base.completion_ids[3].tolist()
    assert not bool(ended(more, engine.eos_token_id).any())  # EOS suppressed: nothing ended
