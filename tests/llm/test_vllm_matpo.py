"""MATPO's planner and worker rollouts on the vLLM engine (:class:`~mmpo.algos.matpo.MATPOModule` with
``rollout_engine: vllm``, a tiny Qwen3): a planner turn that calls ``subagent`` runs a worker rollout on the same vLLM
engine (between two planner calls), and greedy planners and workers equal the HF engine's, token for token, with the
same summaries and tool counts; sampled planner and worker rows score like the trainer's forward;
``configs/agent/matpo_tiny.yaml`` trains 2 steps through ``mmpo fit`` with vLLM rollouts.

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/llm/test_vllm_matpo.py

In a venv without vLLM tests/llm/conftest.py leaves this file out of the collection.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from agent_envs_support import agent_fit_args
from tiny_vlm_support import build_small_text_lm

from mmpo.algos.matpo import MATPOConfig, MATPOModule
from mmpo.data.synthetic import make_items
from mmpo.tools.parsing import ToolCall
from mmpo.training.config import EngineConfig, SamplingConfig
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import completion_attention_mask

# vLLM's float32 CPU forward against the trainer's, as tests/llm/test_vllm_multiturn.py
TOLERANCE = 1e-4


class _AlwaysDelegate:
    """Every message calls the subagent: the planner delegates on each turn (a worker rollout each time); a worker's
    call is an unknown tool (an error answer). Stateless, so the order in which the engines step the environments
    does not matter."""

    def parse(self, text):
        return [ToolCall("subagent", {"subtask": "compute it"})]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """A MATPO module on the HF engine and one on a vLLM engine, on the same tiny Qwen3 (head_dim 32) whose turn-end
    output row is perturbed the same way in both (vLLM gets it by its first weight sync), so greedy turns end after a
    few tokens (planners) or within the turn budget (workers)."""
    path = build_small_text_lm(tmp_path_factory.mktemp("tiny_text"), hidden_size=128, intermediate_size=256)
    settings = dict(agent={"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 120},
                    matpo=MATPOConfig(worker_max_turns=2, worker_max_total_tokens=160, summary_max_chars=20),
                    sampling=SamplingConfig(num_generations=2, max_new_tokens=16))
    built = {}
    for name in ("hf", "vllm"):
        module = MATPOModule(path, rollout_engine=EngineConfig(name=name, vllm_max_model_len=2048,
                                                               vllm_max_num_batched_tokens=4096), **settings)
        eos = module.engine.eos_token_id
        with torch.no_grad():
            weight = module.model.get_output_embeddings().weight
            weight[eos] += torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)) * 0.05
        module.model.eval()
        built[name] = module
    yield built
    for module in built.values():
        module.sandbox.shutdown()


def _greedy(module, rows):
    module.parser = _AlwaysDelegate()
    envs = module.environments(len(rows), do_sample=False)
    planner = module.multiturn.generate(rows, envs, num_samples=1, do_sample=False)
    return planner, envs


def test_greedy_planners_and_workers_equal_the_hf_engine(modules):
    rows = make_items("calc", 3, seed=0)
    hf, hf_envs = _greedy(modules["hf"], rows)
    ours, our_envs = _greedy(modules["vllm"], rows)
    assert modules["vllm"].multiturn.last_schedule == "vllm"
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    assert torch.equal(ours.completion_mask, hf.completion_mask)
    for key in ("turns", "tool_calls"):
        assert torch.equal(ours.extras[key], hf.extras[key]), key
    assert ours.texts == hf.texts
    mask = hf.completion_mask.bool()
    torch.testing.assert_close(ours.extras["engine_log_probs"][mask], hf.extras["engine_log_probs"][mask],
                               atol=TOLERANCE, rtol=0)
    # every planner turn that ended delegated: the same worker trajectories and summaries on both engines
    # not trivial: each planner wrote two turns and delegated after each (a worker between its turns, one after the
    # last); each worker wrote two turns around its tool's error answer and summarised in words
    assert ours.extras["turns"].tolist() == [2, 2, 2]
    assert [len(env.workers) for env in our_envs] == [len(env.workers) for env in hf_envs] == [2, 2, 2]
    assert all(run.rollout.extras["turns"].tolist() == [2] and run.summary for env in our_envs for run in env.workers)
    for mine, theirs in zip(our_envs, hf_envs):
        for run, expected in zip(mine.workers, theirs.workers):
            assert run.summary == expected.summary and run.transcript == expected.transcript
            assert torch.equal(run.rollout.completion_ids, expected.rollout.completion_ids)
            assert torch.equal(run.rollout.completion_mask, expected.rollout.completion_mask)
            trained = expected.rollout.completion_mask.bool()
            torch.testing.assert_close(run.rollout.extras["engine_log_probs"][trained],
                                       expected.rollout.extras["engine_log_probs"][trained], atol=TOLERANCE, rtol=0)
            assert "[CONTEXT]" in str(run.rollout.rows[0]["problem"])
    assert modules["vllm"].tool_stats.metrics() == modules["hf"].tool_stats.metrics()
    assert modules["vllm"].tool_stats.metrics()["tools/subagent/calls"] == sum(len(env.workers) for env in our_envs)


def test_sampled_planner_and_worker_rows_score_like_the_trainer(modules):
    module = modules["vllm"]
    module.parser = _AlwaysDelegate()
    # temperature 0.3: low enough that sampled planner turns end (and delegate) within their 16 tokens
    module.sampling = dataclasses.replace(module.sampling, temperature=0.3)
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("calc", 2, seed=1))
    parents = rollout.extras["matpo_parent"]
    assert parents[:4].tolist() == [-1] * 4 and int((parents >= 0).sum()) >= 1  # planners first, then workers
    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(module.model, rollout.prompt_inputs, rollout.completion_ids, attention,
                                            temperature=module.sampling.temperature)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=TOLERANCE, rtol=0)


def test_matpo_trains_two_steps_with_vllm_rollouts(tmp_path):
    """configs/agent/matpo_tiny.yaml with ``rollout_engine: vllm``: 2 steps through ``mmpo fit`` (planners and their
    workers sampled by vLLM), validation greedy on vLLM."""
    from mmpo.cli import main

    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400"]) == 0  # head_dim 32
    config = Path(__file__).resolve().parents[2] / "configs" / "agent" / "matpo_tiny.yaml"
    logs = tmp_path / "logs"
    assert main(agent_fit_args(config, base, tmp_path, "--model.init_args.sampling.num_generations=2",
                               "--model.init_args.sampling.max_new_tokens=8", "--model.init_args.agent.max_total_tokens=40",
                               "--model.init_args.matpo.worker_max_total_tokens=24",
                               "--model.init_args.rollout_engine.name=vllm",
                               "--model.init_args.rollout_engine.vllm_max_model_len=1024",
                               "--model.init_args.rollout_engine.vllm_max_num_batched_tokens=4096")) == 0
    (path,) = logs.glob("**/metrics.csv")
    logged = {key for row in csv.DictReader(path.open()) for key, value in row.items() if value}
    assert {"matpo/workers_per_planner", "matpo/worker_tokens_mean", "losses/policy", "val/accuracy"} <= logged
    records = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 2 * 2 * 2 and {record["step"] for record in records} == {0, 1}
