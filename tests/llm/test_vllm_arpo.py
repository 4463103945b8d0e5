"""ARPO's branching rollouts on the vLLM engine (:class:`~mmpo.algos.arpo.ARPOEngine` over
:class:`~mmpo.vlm.vllm_engine.VLLMEngine`, a tiny Qwen3): each round is one vLLM call with ``logprobs=10``, and the
entropy that drives the branching comes from the returned top log-probs, as in the official code
(dongguanting/ARPO ``vllm_rollout_with_tools.py``). The entropies equal those of the trainer's forward, the sampled
tokens' log-probs too; the budget, the forks (with their source's turns and tool answers) and the top-ups behave as
on the HF engine; ``configs/agent/arpo_tiny.yaml`` trains 2 steps through ``mmpo fit`` with vLLM rollouts.

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/llm/test_vllm_arpo.py

In a venv without vLLM tests/llm/conftest.py leaves this file out of the collection.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, agent_fit_args, trainer_segment_entropies
from tiny_vlm_support import build_small_text_lm

from mmpo.algos.arpo import ARPOConfig, ARPOEngine
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import completion_attention_mask
from mmpo.vlm.processing import encode_prompts
from mmpo.vlm.vllm_engine import VLLMEngine

# vLLM's float32 CPU forward against the trainer's, as tests/llm/test_vllm_multiturn.py
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One vLLM engine for the module, on a tiny Qwen3 (head_dim 32) whose turn-end output row points along the mean
    of its final hidden states (vLLM's Qwen3 has no lm_head bias), so that sampled turns end within a few tokens."""
    path = build_small_text_lm(tmp_path_factory.mktemp("tiny_text"), hidden_size=128, intermediate_size=256)
    model, processor = load_vlm(path)
    eos = model.generation_config.eos_token_id
    inputs = encode_prompts(processor, make_items("long_arithmetic", 4, seed=5))
    with torch.no_grad():
        hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        mean = hidden[inputs["attention_mask"] > 0].mean(0)
        model.get_output_embeddings().weight[eos] = mean / mean.norm() ** 2 * 5.0  # a turn-end logit of about 5
    model.eval()
    vllm = VLLMEngine(model, processor, model_path=str(path), max_model_len=1024, max_num_batched_tokens=4096)
    return model, processor, vllm


def _engine(vllm, **settings):
    return ARPOEngine(vllm, ARPOConfig(**settings), max_turns=3, max_total_tokens=200, max_tokens_per_turn=24)


def test_branching_on_vllm_reads_the_entropy_of_the_returned_top_logprobs(engines):
    model, processor, vllm = engines
    engine = _engine(vllm, initial_rollouts=1, beam_size=2, branch_probability=1.0)
    rows = make_items("long_arithmetic", 2, seed=0)
    temperature = 0.7
    torch.manual_seed(0)
    rollout = engine.generate(rows, [ScriptedEnvironment() for _ in range(8)], num_samples=4, temperature=temperature)
    # per prompt: 1 global trajectory; round 1 forks it (2); round 2 forks both (4); round 3 ends them
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.last_stats["arpo/forks"] == 6.0 and engine.last_stats["arpo/topups"] == 0.0
    assert engine.last_stats["arpo/forked_frac"] == 0.75
    assert rollout.extras["turns"].tolist() == [3] * 8 and rollout.extras["tool_calls"].tolist() == [2] * 8
    attention = completion_attention_mask(rollout)
    for group in (0, 4):
        first, fork = rollout.completion_ids[group], rollout.completion_ids[group + 1]
        holes = torch.nonzero((rollout.completion_mask[group] == 0) & (attention[group] == 1)).flatten()
        end_of_first_answer = int(holes[0]) + 1
        while rollout.completion_mask[group, end_of_first_answer] == 0:
            end_of_first_answer += 1
        # the branch made after round 1 holds its source's first turn and first tool answer, then its own turns
        assert torch.equal(first[:end_of_first_answer], fork[:end_of_first_answer])
        assert not torch.equal(first, fork)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention,
                                            temperature=temperature)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=TOLERANCE, rtol=0)
    # the entropy of every segment (vLLM's top-10 log-probs of its first 20 positions, pooled) equals the one the
    # trainer's forward gives at the same temperature; the entropy change is not 0, so beta acts on it
    expected = trainer_segment_entropies(model, rollout, temperature=temperature,
                                         vocab_size=len(processor.tokenizer.get_vocab()))
    assert [len(e) for e in engine.last_entropies] == [3] * 8
    for mine, theirs in zip(engine.last_entropies, expected):
        assert mine == pytest.approx(theirs, abs=TOLERANCE)
    assert engine.last_stats["arpo/entropy_delta_mean"] != 0.0


def test_never_forking_on_vllm_tops_up_with_global_trajectories(engines):
    _, _, vllm = engines
    engine = _engine(vllm, initial_rollouts=2, beam_size=2, branch_probability=0.0, entropy_weight=0.0)
    torch.manual_seed(1)
    rollout = engine.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment() for _ in range(8)],
                              num_samples=4)
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.last_stats["arpo/forks"] == 0.0 and engine.last_stats["arpo/topups"] == 4.0
    assert engine.last_stats["arpo/forked_frac"] == 0.0
    assert rollout.extras["turns"].tolist() == [3] * 8
    # the draws are seeded: the same torch seed and branching state give the same trajectories
    again_engine = _engine(vllm, initial_rollouts=2, beam_size=2, branch_probability=0.0, entropy_weight=0.0)
    torch.manual_seed(1)
    again = again_engine.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment() for _ in range(8)],
                                  num_samples=4)
    assert torch.equal(again.completion_ids, rollout.completion_ids)


def test_arpo_trains_two_steps_with_vllm_rollouts(tmp_path):
    """configs/agent/arpo_tiny.yaml with ``rollout_engine: vllm``: 2 steps through ``mmpo fit`` (branching on vLLM,
    the sandboxed calculator, hard attribution), validation greedy on vLLM."""
    from mmpo.cli import main

    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400"]) == 0  # head_dim 32
    config = Path(__file__).resolve().parents[2] / "configs" / "agent" / "arpo_tiny.yaml"
    logs = tmp_path / "logs"
    assert main(agent_fit_args(config, base, tmp_path, "--model.init_args.sampling.num_generations=4",
                               "--model.init_args.arpo.initial_rollouts=2", "--model.init_args.sampling.max_new_tokens=8",
                               "--model.init_args.agent.max_total_tokens=40", "--model.init_args.arpo.attribution=hard",
                               "--model.init_args.rollout_engine.name=vllm",
                               "--model.init_args.rollout_engine.vllm_max_model_len=1024",
                               "--model.init_args.rollout_engine.vllm_max_num_batched_tokens=4096")) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged = {key for row in csv.DictReader(path.open()) for key, value in row.items() if value}
    assert {"arpo/forks", "arpo/topups", "arpo/forked_frac", "agent/tool_calls_mean", "losses/policy",
            "val/accuracy"} <= logged
    records = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 4  # 2 steps x 2 prompts x n = 4
