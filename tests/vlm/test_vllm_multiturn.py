"""Multi-turn rollouts of a VLM on the vLLM engine (``MultiTurnEngine`` over :class:`~mmpo.vlm.vllm_engine.VLLMEngine`,
a tiny Qwen2.5-VL whose tool answers are images): greedy decoding gives the HF engine's tokens, every one, with the same
masks, images, turn and tool counts and log-probs; sampled trajectories score like the trainer's forward over the whole
conversation (tool images included); tool errors and token budgets end and count turns as on the HF engine; ARPO
branches image conversations.

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/vlm/test_vllm_multiturn.py

In a venv without vLLM tests/vlm/conftest.py leaves this file out of the collection.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from agent_envs_support import VariedCrops, agent_fit_args, trainer_segment_entropies
from tiny_vlm_support import build_small_vlm

from mmpo.algos.arpo import ARPOConfig, ARPOEngine
from mmpo.data.synthetic import make_items
from mmpo.tools.env import ToolEnvironment, ToolStats
from mmpo.tools.functions import load_tools
from mmpo.tools.parsing import MalformedCall, ToolCall
from mmpo.tools.sandbox import SandboxLimits, ToolSandbox
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_hidden_states
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask
from mmpo.vlm.processing import vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.vllm_engine import VLLMEngine

# vLLM's float32 CPU forward against the trainer's (both fp32, different kernels), as tests/llm/test_vllm_multiturn.py
LOG_PROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One vLLM engine for the module, on a tiny Qwen2.5-VL (head_dim 32: vLLM's CPU attention has no smaller kernel)
    whose turn-end token's output row is replaced by a small random one (vLLM's Qwen2.5-VL has no lm_head bias), so
    that greedy turns end after a few tokens, at different steps in different trajectories, and some run into the
    per-turn budget."""
    path = build_small_vlm(tmp_path_factory.mktemp("tiny_vlm"), hidden_size=128, intermediate_size=256)
    model, processor = load_vlm(path)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[eos] = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)) * 0.05
    model.eval()
    vllm = VLLMEngine(model, processor, model_path=str(path), max_model_len=1024, max_num_batched_tokens=4096)
    return model, processor, vllm


def _engine(engine, **limits):
    return MultiTurnEngine(engine, **{"max_turns": 3, "max_total_tokens": 300, "max_tokens_per_turn": 24, **limits})


def _model_turns(rollout, i):
    """``[(start, length)]`` of trajectory ``i``'s model turns (runs of trained tokens) in its completion."""
    mask, attention = rollout.completion_mask[i].tolist(), completion_attention_mask(rollout)[i].tolist()
    turns, run = [], 0
    for position, (trained, real) in enumerate(zip(mask + [0], attention + [0])):
        if trained and real:
            run += 1
        elif run:
            turns.append((position - run, run))
            run = 0
    return turns


def _model_turn_lengths(rollout, i):
    return [length for _, length in _model_turns(rollout, i)]


def _model_turn_starts(rollout, i):
    return [start for start, _ in _model_turns(rollout, i)]


def _assert_same(ours, hf, ours_engine, hf_engine):
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    assert torch.equal(completion_attention_mask(ours), completion_attention_mask(hf))
    for key in ("turns", "tool_calls", "env_rewards"):
        assert torch.equal(ours.extras[key], hf.extras[key]), key
    assert ours.texts == hf.texts and ours_engine.last_transcripts == hf_engine.last_transcripts
    assert ours.group_ids.tolist() == hf.group_ids.tolist()
    for key in ("input_ids", "attention_mask", "image_counts", "tool_image_counts", "image_grid_thw", "pixel_values"):
        assert torch.equal(ours.prompt_inputs[key], hf.prompt_inputs[key]), key
    mask = hf.completion_mask.bool()
    torch.testing.assert_close(ours.extras["engine_log_probs"][mask], hf.extras["engine_log_probs"][mask],
                               atol=LOG_PROB_TOLERANCE, rtol=0)
    assert torch.all(ours.extras["engine_log_probs"][~mask] == 0)


def test_greedy_multi_turn_with_image_answers_equals_the_hf_engine(engines):
    model, processor, vllm = engines
    rows = make_items("zoom", 2, seed=0)
    ours_engine = _engine(vllm)
    ours = ours_engine.generate(rows, [VariedCrops(salt) for salt in range(4)], num_samples=2, do_sample=False)
    hf_engine = _engine(HFGenerateEngine(model, processor))
    hf = hf_engine.generate(rows, [VariedCrops(salt) for salt in range(4)], num_samples=2, do_sample=False)
    assert ours_engine.last_schedule == "vllm" and hf_engine.last_schedule == "continuous"
    _assert_same(ours, hf, ours_engine, hf_engine)
    # not trivial: crops of different sizes went into the conversations (the prompt's image, then one or two crops),
    # turns ended at different lengths, and two trajectories ran into the per-turn budget (24) on their second turn
    assert ours.prompt_inputs["tool_image_counts"].tolist() == [2, 1, 2, 1]
    assert len({tuple(g) for g in ours.prompt_inputs["image_grid_thw"].tolist()}) >= 3
    assert [_model_turn_lengths(ours, i) for i in range(4)] == [[7, 4, 4], [7, 24], [7, 4, 4], [7, 24]]
    # vLLM's prefix cache served each later turn's earlier context in whole KV blocks (128 tokens on the CPU backend):
    # at least the full blocks of the previous turn's context, so less than the whole context was prefilled again
    block = vllm.llm.llm_engine.vllm_config.cache_config.block_size
    contexts = [[int(ours.prompt_inputs["attention_mask"][i].sum()) + start for start in _model_turn_starts(ours, i)]
                for i in range(4)]
    later = sum(c[k] for c in contexts for k in range(1, len(c)))
    at_most = sum(c[k] - block * (c[k - 1] // block) for c in contexts for k in range(1, len(c)))
    assert 0 < ours_engine.last_prefill_tokens <= at_most < later


def test_sampled_multi_turn_with_image_answers_scores_like_the_trainer(engines):
    """The sampler's log-probs (vision tokens masked, temperature 0.3, the distribution it drew from) equal the
    trainer's forward over prompt + conversation, the tool images encoded in it, with the same mask and temperature."""
    model, processor, vllm = engines
    engine = _engine(vllm, max_total_tokens=160)
    temperature = 0.3  # low enough that some sampled turns end within the 24-token turn budget
    rows = make_items("zoom", 3, seed=1)
    torch.manual_seed(0)
    rollout = engine.generate(rows, [VariedCrops(salt) for salt in range(9)], num_samples=3, temperature=temperature)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert int(rollout.prompt_inputs["tool_image_counts"].sum()) >= 2  # image answers in the context
    attention = completion_attention_mask(rollout)
    assert int(attention.sum(-1).max()) <= 160
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids, attention)
        logits = model.get_output_embeddings()(hidden).float() / temperature
        logits[..., vision_token_ids(processor)] = float("-inf")
        expected = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.extras["engine_log_probs"][trained], expected[trained],
                               atol=LOG_PROB_TOLERANCE, rtol=0)
    # seeded from torch's RNG: the same seed draws the same trajectories, another seed other ones
    torch.manual_seed(0)
    again = engine.generate(rows, [VariedCrops(salt) for salt in range(9)], num_samples=3, temperature=temperature)
    assert torch.equal(again.completion_ids, rollout.completion_ids)
    torch.manual_seed(1)
    other = engine.generate(rows, [VariedCrops(salt) for salt in range(9)], num_samples=3, temperature=temperature)
    assert not torch.equal(other.completion_ids, rollout.completion_ids)


class _ScriptedCalls:
    """A tool-call parser that ignores the model's text (a random tiny model never writes a call) and returns, turn by
    turn: a valid zoom call (an image answer), preceded for odd ``salt`` by a broken call (an error text); then a box
    outside the image and a second valid call (an error and an image); then nothing (the trajectory's final answer)."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.turn = 0

    def parse(self, text: str):
        self.turn += 1
        box = [28 * self.salt, 0, 28 * self.salt + 112 + 56 * (self.salt % 2), 112]
        if self.turn == 1:
            broken = [MalformedCall("the tool call is not valid JSON")] if self.salt % 2 else []
            return [*broken, ToolCall("image_zoom_in_tool", {"bbox_2d": box})]
        if self.turn == 2:
            return [ToolCall("image_zoom_in_tool", {"bbox_2d": [9000, 9000, 9100, 9100]}),
                    ToolCall("image_zoom_in_tool", {"bbox_2d": [0, 0, 224, 112]})]
        return []


@pytest.mark.parametrize("max_total_tokens", [300, 60])
def test_the_zoom_tool_errors_and_budgets_run_as_on_the_hf_engine(engines, max_total_tokens):
    """The real ``image_zoom_in_tool`` through the sandbox (scripted calls): image answers, a box outside the image and a
    broken call (error texts to the model, counted), and a trajectory budget that an image answer does not fit (60:
    the trajectory ends there); both engines give the same trajectories and the same tool counts."""
    model, processor, vllm = engines
    tools = load_tools(["image_zoom_in_tool"])
    sandbox = ToolSandbox(SandboxLimits(timeout_s=5.0))
    try:
        results = []
        for engine in (vllm, HFGenerateEngine(model, processor)):
            stats = ToolStats()
            envs = [ToolEnvironment(tools, sandbox, parser=_ScriptedCalls(salt), stats=stats) for salt in range(4)]
            for env in envs:
                env.tools = []  # no schemas in the system prompt: the tiny tokenizer spells them out in ~2000 tokens
            multiturn = _engine(engine, max_total_tokens=max_total_tokens)
            rollout = multiturn.generate(make_items("zoom", 2, seed=0), envs, num_samples=2, do_sample=False)
            results.append((rollout, multiturn, stats.metrics()))
        (ours, ours_engine, ours_stats), (hf, hf_engine, hf_stats) = results
        _assert_same(ours, hf, ours_engine, hf_engine)
        assert ours_stats == hf_stats
        transcripts = ours_engine.last_transcripts
        errors = [m["content"] for t in transcripts for m in t if m["role"] == "tool" and "Error" in m["content"]]
        # even trajectories: 3 model turns (the crop; the out-of-image box and the second crop; the answer); odd ones: the
        # broken call and the crop, then a second turn that runs into the 24-token turn budget (no tool step)
        assert ours.extras["tool_calls"].tolist() == [3, 2, 3, 2]
        assert ours_stats["tools/image_zoom_in_tool/calls"] == 8.0 and ours_stats["tools/image_zoom_in_tool/errors"] == 2.0
        if max_total_tokens == 300:
            assert ours.extras["turns"].tolist() == [3, 2, 3, 2]
            assert ours.prompt_inputs["tool_image_counts"].tolist() == [2, 1, 2, 1]
            assert sum("outside the 448x448 image" in e for e in errors) == 2
        else:  # 60 tokens: an answer that does not fit ends the trajectory (the odd ones' first: an error and a crop;
            # the even ones' second: an error and a 224 x 112 crop); the tools ran, so the counts are the same
            assert int(completion_attention_mask(ours).sum(-1).max()) <= 60
            assert ours.prompt_inputs["tool_image_counts"].tolist() == [1, 0, 1, 0]
            assert ours.extras["turns"].tolist() == [2, 1, 2, 1]
        assert sum("not valid JSON" in e for e in errors) == 2
    finally:
        sandbox.shutdown()


def test_arpo_branches_image_conversations_on_vllm(engines):
    """ARPO on a VLM whose tool answers are crops, on vLLM: every fork carries its source's tokens and images; the
    sampled log-probs and the segment entropies the branching read (vLLM's top-10 log-probs, vision tokens masked)
    equal the trainer's forward over the conversations with their tool images."""
    model, processor, vllm = engines
    engine = ARPOEngine(vllm, ARPOConfig(initial_rollouts=1, beam_size=2, branch_probability=1.0), max_turns=3,
                        max_total_tokens=160, max_tokens_per_turn=24)
    temperature = 0.3
    torch.manual_seed(0)
    rollout = engine.generate(make_items("zoom", 2, seed=1), [VariedCrops(salt) for salt in range(8)], num_samples=4,
                              temperature=temperature)
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.last_stats["arpo/forks"] >= 2  # branches of conversations that hold a crop
    images = rollout.prompt_inputs["tool_image_counts"]
    assert int(images.sum()) >= 4
    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids, attention)
        logits = model.get_output_embeddings()(hidden).float() / temperature
        logits[..., vision_token_ids(processor)] = float("-inf")
        expected = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.extras["engine_log_probs"][trained], expected[trained],
                               atol=LOG_PROB_TOLERANCE, rtol=0)
    entropies = trainer_segment_entropies(model, rollout, temperature=temperature,
                                          vocab_size=len(processor.tokenizer.get_vocab()),
                                          suppressed=vision_token_ids(processor))
    assert [len(e) for e in engine.last_entropies] == [len(e) for e in entropies]
    for mine, theirs in zip(engine.last_entropies, entropies):
        assert mine == pytest.approx(theirs, abs=LOG_PROB_TOLERANCE)


def test_more_images_than_the_engine_takes_per_prompt_are_refused(engines):
    _, _, vllm = engines
    limit = vllm.max_images_per_prompt
    vllm.max_images_per_prompt = 1  # the prompt's image fits; the first crop makes two
    try:
        with pytest.raises(ValueError, match="2 images > the vLLM engine's 1 per prompt"):
            _engine(vllm).generate(make_items("zoom", 1, seed=0), [VariedCrops(0)], num_samples=1, do_sample=False)
    finally:
        vllm.max_images_per_prompt = limit


def test_zoom_grpo_trains_two_steps_with_vllm_rollouts(tmp_path):
    """configs/agent/zoom_grpo_tiny.yaml with ``rollout_engine: vllm`` (a VLM): 2 steps through ``mmpo fit``, the
    rollouts multi-turn with the sandboxed zoom tool, validation greedy on vLLM too."""
    from mmpo.cli import main

    base = build_small_vlm(tmp_path / "vlm_base", hidden_size=128, intermediate_size=256)  # head_dim 32
    config = Path(__file__).resolve().parents[2] / "configs" / "agent" / "zoom_grpo_tiny.yaml"
    logs = tmp_path / "logs"
    assert main(agent_fit_args(config, base, tmp_path, "--model.init_args.sampling.num_generations=2",
                               "--model.init_args.sampling.max_new_tokens=8",
                               "--model.init_args.agent.max_total_tokens=40", "--model.init_args.rollout_engine.name=vllm",
                               "--model.init_args.rollout_engine.vllm_max_model_len=2048",
                               "--model.init_args.rollout_engine.vllm_max_num_batched_tokens=8192")) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged = {key for row in csv.DictReader(path.open()) for key, value in row.items() if value}
    assert {"agent/turns_mean", "agent/tool_calls_mean", "losses/policy", "val/accuracy"} <= logged
    records = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and {record["step"] for record in records} == {0, 1}
