"""The turn-synchronous schedule (``schedule="turns"``; the default continuous batching: test_continuous_batching.py).
Multi-turn rollouts keep the KV cache across turns: each later turn prefills only its new tokens (the last turn's
final token and the environment's answer) onto the kept cache and decodes with the engine's lean loop. From the same
RNG state the kept-cache rollout draws exactly the tokens the re-prefilling one draws, with the same log-probs, on a
tiny Qwen3 (text answers) and a tiny Qwen2.5-VL (image answers: 3-D RoPE positions of the new vision tokens), while
running a fraction of the context through the model."""

from __future__ import annotations

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, ZoomingEnvironment
from tiny_vlm_support import build_small_text_lm, build_small_vlm

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask
from mmpo.vlm.processing import vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine


def _biased(model, processor, eos_bias):
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = eos_bias
        biased.bias[vision_token_ids(processor)] = -40.0  # suppressed by the sampler; ~0 in the training forward too
    model.lm_head = biased
    return model.eval(), processor


@pytest.fixture(scope="module", params=["text", "vlm"])
def case(request, tmp_path_factory):
    if request.param == "text":
        model, processor = _biased(*load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text"))), 3.0)
        return model, processor, make_items("long_arithmetic", 2, seed=0), ScriptedEnvironment
    model, processor = _biased(*load_vlm(build_small_vlm(tmp_path_factory.mktemp("vlm"))), 2.0)
    return model, processor, make_items("zoom", 2, seed=0), ZoomingEnvironment


def _run(case, keep_cache, seed=0):
    model, processor, rows, environment = case
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=300,
                             max_tokens_per_turn=24, keep_cache=keep_cache, schedule="turns")
    torch.manual_seed(seed)
    return engine.generate(rows, [environment() for _ in range(6)], num_samples=3), engine


@pytest.mark.parametrize("seed", [0, 1])
def test_kept_cache_draws_the_same_tokens_and_log_probs_as_re_prefilling(case, seed):
    kept, kept_engine = _run(case, True, seed)
    again, again_engine = _run(case, False, seed)
    assert max(kept.extras["turns"].tolist()) >= 2  # later turns ran
    assert torch.equal(kept.completion_ids, again.completion_ids)
    assert torch.equal(kept.completion_mask, again.completion_mask)
    torch.testing.assert_close(kept.extras["engine_log_probs"], again.extras["engine_log_probs"], atol=1e-5, rtol=0)
    # and both equal the training forward over the whole conversation
    attention = completion_attention_mask(kept)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(case[0], kept.prompt_inputs, kept.completion_ids, attention)
    trained = kept.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], kept.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
    # only the new tokens were prefilled: per environment answer, its tokens (+ the turn's unfed last token, - the
    # token the decode loop feeds itself), never the conversation before it
    holes = (attention - kept.completion_mask).sum().item()
    answers = sum(t - 1 for t in kept.extras["turns"].tolist())
    assert holes - answers <= kept_engine.last_prefill_tokens <= holes
    assert kept_engine.last_prefill_tokens * 3 < again_engine.last_prefill_tokens


def test_greedy_rollouts_re_prefill(case):
    model, processor, rows, environment = case
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=300,
                             max_tokens_per_turn=24, schedule="turns")
    rollout = engine.generate(rows, [environment() for _ in range(2)], num_samples=1, do_sample=False)
    if max(rollout.extras["turns"].tolist()) > 1:
        assert engine.last_prefill_tokens > 0 and engine.engine.last_decode == "greedy"
    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
