"""MATPO: the advantage broadcast and the loss normaliser against the official functions (mzf666/MATPO,
transcribed below), the planner environment, and two training steps on a tiny Qwen3 whose planner calls workers."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from tiny_vlm_support import build_small_text_lm
from torch.utils.data import DataLoader

from mmpo.algos.matpo import (MATPOConfig, MATPOModule, PlannerEnvironment, WorkerRun, broadcast_to_workers,
                              planner_sequence_count, worker_request, worker_summary)
from mmpo.core import aggregate
from mmpo.data.synthetic import make_items
from mmpo.tools.parsing import HermesToolCallParser, ToolCall
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig
from mmpo.rewards import REWARDS
from mmpo.vlm.rollout import Rollout

def _chars(completions, rows):
    """A reward that differs between samples: the final message's length / 10."""
    return torch.tensor([len(text) / 10 for text in completions], dtype=torch.float32)

# ---------------------------------------------------------------- official reference (transcribed)
# mzf666/MATPO verl/protocol.py, broadcast_advantage_return_tensor_by_reqs_ids (commit ee2bef7), on plain objects
# with .batch (dict of tensors) and .non_tensor_batch (dict of numpy arrays) in place of DataProto.


def official_broadcast_advantage_return_tensor_by_reqs_ids(data_main_agent, data_from_subagent_tool, data_padded):
    req_id_to_idx = {uid: i for i, uid in enumerate(data_main_agent.non_tensor_batch["reqs_ids"])}
    idx_list = np.vectorize(req_id_to_idx.get)(data_from_subagent_tool.non_tensor_batch["parent_reqs_ids"])
    data_from_subagent_tool.batch["advantages"] = data_main_agent.batch["advantages"][idx_list]
    data_from_subagent_tool.batch["returns"] = data_main_agent.batch["returns"][idx_list]
    if data_padded is not None:
        device = data_main_agent.batch["token_level_scores"].device
        data_padded.batch["advantages"] = torch.zeros_like(data_padded.batch["token_level_scores"], device=device)
        data_padded.batch["returns"] = torch.zeros_like(data_padded.batch["token_level_scores"], device=device)
    return data_from_subagent_tool, data_padded


# mzf666/MATPO verl/protocol.py (commit ee2bef7), get_num_valid_seqs (a dict in place of the TensorDict)
def official_get_num_valid_seqs(data):
    if "is_pad" in data.keys():
        is_pad = data["is_pad"]
        num_not_pad = (~is_pad).sum().detach().item()
    else:
        is_pad = None
        num_not_pad = None
    is_from_subagent_tool = data.get("is_from_subagent_tool")
    if is_from_subagent_tool is not None:
        is_valid = (~is_from_subagent_tool).detach().cpu().numpy()
        if is_pad is not None:
            is_valid &= (~is_pad).detach().cpu().numpy()
        num_valid_seqs = is_valid.sum().item()
    else:
        num_valid_seqs = num_not_pad
    return num_valid_seqs, num_not_pad


def _masked_mean(values, mask):  # verl.utils.torch_functional.masked_mean
    return (values * mask).sum() / mask.sum()


# mzf666/MATPO verl/trainer/ppo/core_algos.py @ 3c41d62, agg_loss
def official_agg_loss(loss_mat, loss_mask, loss_agg_mode, num_valid_seqs=None):
    bs = loss_mat.shape[0]
    num_valid_seqs = bs if num_valid_seqs is None else num_valid_seqs
    if loss_agg_mode == "token-mean":
        loss = _masked_mean(loss_mat, loss_mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
        loss = loss * bs / max(1, num_valid_seqs)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
        loss = loss * bs / max(1, num_valid_seqs)
    else:
        raise ValueError(loss_agg_mode)
    return loss


# ---------------------------------------------------------------- parity and hand values

def test_broadcast_matches_the_official_function_and_hand_values():
    planner_adv = torch.tensor([0.5, -0.5, 1.25, -1.25])
    parents = torch.tensor([-1, -1, -1, -1, 0, 2, 2, 3, 0])
    ours = broadcast_to_workers(planner_adv, parents)
    assert ours.tolist() == [0.5, -0.5, 1.25, -1.25, 0.5, 1.25, 1.25, -1.25, 0.5]

    main = SimpleNamespace(batch={"advantages": planner_adv, "returns": planner_adv.clone(),
                                  "token_level_scores": torch.zeros(4)},
                           non_tensor_batch={"reqs_ids": np.array(["a", "b", "c", "d"], dtype=object)})
    sub = SimpleNamespace(batch={}, non_tensor_batch={
        "parent_reqs_ids": np.array(["a", "c", "c", "d", "a"], dtype=object)})
    official, _ = official_broadcast_advantage_return_tensor_by_reqs_ids(main, sub, None)
    assert torch.equal(ours[4:], official.batch["advantages"])
    assert torch.equal(ours[:4], planner_adv)  # the planners keep their own


def test_broadcast_rejects_a_rollout_whose_planners_are_not_first():
    with pytest.raises(ValueError, match="planner rows first"):
        broadcast_to_workers(torch.tensor([1.0, 2.0]), torch.tensor([-1, 0, -1]))
    with pytest.raises(ValueError, match="not a planner row"):
        broadcast_to_workers(torch.tensor([1.0, 2.0]), torch.tensor([-1, -1, 2]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_normaliser_matches_the_official_agg_loss(mode):
    # 3 planner rows then 2 worker rows; per-token losses and masks of different lengths
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [2.0, 2.0, 2.0], [4.0, -2.0, 1.0], [0.25, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    parents = torch.tensor([-1, -1, -1, 0, 1])
    is_from_subagent = parents >= 0
    num_valid, num_not_pad = official_get_num_valid_seqs({"is_from_subagent_tool": is_from_subagent})
    assert num_valid == planner_sequence_count(parents) == 3 and num_not_pad is None
    expected = official_agg_loss(loss_mat, mask, mode, num_valid_seqs=num_valid)
    ours = aggregate(loss_mat, mask, mode, global_tokens=mask.sum(), global_seqs=float(planner_sequence_count(parents)))
    assert torch.allclose(ours, expected)
    if mode == "seq-mean-token-sum":  # by hand: row sums 6, -0.5, 2, 3, 0.25 -> 10.75 / 3 planner rollouts
        assert torch.allclose(ours, torch.tensor(10.75 / 3))


def test_num_valid_seqs_with_padding_matches_the_official_count():
    parents = torch.tensor([-1, -1, 0, -1, 1])
    is_pad = torch.tensor([False, False, False, True, False])  # the official padding row: not counted
    num_valid, num_not_pad = official_get_num_valid_seqs({"is_from_subagent_tool": parents >= 0, "is_pad": is_pad})
    assert (num_valid, num_not_pad) == (2, 4)
    assert planner_sequence_count(parents[~is_pad]) == num_valid


def test_worker_summary_and_request():
    assert worker_summary("<think>plan</think>\n\nanswer 7", max_chars=100) == "answer 7"
    assert worker_summary("<think>plan</think>\n\nanswer 7", max_chars=3, drop_think=False) == "<th"
    text = worker_request("What is 2+3*4?", "compute 3*4")
    assert '"What is 2+3*4?"' in text and '"compute 3*4"' in text and text.startswith("[CONTEXT]")


def test_planner_environment_runs_a_worker_per_valid_call():
    calls = []

    def run_worker(row, subtask):
        calls.append((row["problem"], subtask))
        return WorkerRun(f"done: {subtask}", rollout=None)  # type: ignore[arg-type]

    env = PlannerEnvironment(run_worker, HermesToolCallParser(), max_calls_per_turn=2)
    assert env.reset({"problem": "Q"}) == "Q"
    message = ('<tool_call>{"name": "subagent", "arguments": {"subtask": "a"}}</tool_call>'
               '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "subagent", "arguments": {"subtask": "b"}}</tool_call>')
    result = env.step(message)
    assert calls == [("Q", "a")]  # the third call is past max_calls_per_turn
    assert [m["content"] for m in result.observation] == [
        "done: a", "Error: unknown tool 'search'; available: ['subagent']", "Error: at most 2 tool calls per turn"]
    assert result.info["tool_calls"] == 3 and not result.done
    assert env.step('<tool_call>{"name": "subagent", "arguments": {}}</tool_call>').observation[0]["content"] \
        .startswith("Error: subagent needs")
    assert env.step("the answer is 14").done
    assert env.stats.metrics()["tools/subagent/calls"] == 3.0 and env.stats.metrics()["tools/invalid/calls"] == 1.0
    assert [run.summary for run in env.workers] == ["done: a"]


# ---------------------------------------------------------------- two steps with workers

class _AlwaysDelegate:
    """Every message calls the subagent: the planner delegates on each turn; a worker's call is an unknown tool."""

    def parse(self, text):
        return [ToolCall("subagent", {"subtask": "compute it"})]


class _Recording(MATPOModule):
    def end_step(self, state):
        super().end_step(state)
        self.seen = getattr(self, "seen", []) + [(state.rollout, state.rewards, state.advantages,
                                                   dict(state.metrics))]


def test_two_steps_train_planner_and_workers(tmp_path, monkeypatch):
    # registered for this test only: a name left in the registry would reach other tests (`mmpo list`)
    monkeypatch.setitem(REWARDS, "matpo_test_chars", _chars)
    torch.manual_seed(0)
    module = _Recording(build_small_text_lm(tmp_path / "lm"), agent={"tools": ["calculator"], "max_turns": 2,
                                                                     "max_total_tokens": 120},
                        matpo=MATPOConfig(worker_max_turns=2, worker_max_total_tokens=60, summary_max_chars=20),
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=10), 
                        loss=LossConfig(beta=0.0, agg="seq-mean-token-sum"),
                        optim=OptimConfig(lr=1e-3), rewards=RewardConfig(weights={"matpo_test_chars": 1.0},
                                                                         timeout_s=None))
    module.parser = _AlwaysDelegate()
    head = module.model.lm_head  # a bias towards the turn-end token: turns end, so the environment answers
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[module.engine.eos_token_id] = 4.0
    module.model.lm_head = biased
    before = [p.detach().clone() for p in module.model.parameters()]
    rows = DataLoader(make_items("calc", 4, seed=0), batch_size=2, collate_fn=list)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path / "run")
    trainer.fit(module, rows)
    # the rollout log holds every planner and worker trajectory of both steps
    records = (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
    assert len(records) == sum(len(seen[0]) for seen in module.seen)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert any(bool(advantages.abs().sum() > 0) for _, _, advantages, _ in module.seen)
    for rollout, rewards, advantages, metrics in module.seen:
        parents = rollout.extras["matpo_parent"].cpu()
        assert parents[:4].tolist() == [-1] * 4 and bool((parents[4:] >= 0).all())
        # every planner ended its first turn and delegated: one worker per planner turn answered
        assert len(rollout) > 4
        assert metrics["matpo/workers_per_planner"] == (len(rollout) - 4) / 4
        workers = torch.nonzero(parents >= 0).flatten()
        assert torch.equal(advantages[workers].cpu(), advantages[parents[workers]].cpu())
        assert torch.equal(rewards[workers].cpu(), rewards[parents[workers]].cpu())
        # GRPO over the 2 planner rows of each question: the pair's advantages are opposite (or both 0)
        assert torch.allclose(advantages[0] + advantages[1], torch.tensor(0.0), atol=1e-6)
        assert "[CONTEXT]" in str(rollout.rows[4]["problem"])
        assert float(module.loss_sequence_count(rollout, torch.arange(len(rollout)), torch.tensor(9.0))) == 4.0
        assert isinstance(rollout, Rollout) and rollout.completion_mask[workers].sum() > 0


def test_lookup_tool_and_twohop_rows_agree():
    from mmpo.tools.lookup import CITIES, city_of, lookup, population_of

    row = make_items("twohop", 3, seed=1)[2]
    person = row["problem"].removeprefix("How many people live in the city where ").removesuffix(" lives?")
    city = city_of(person)
    assert city in CITIES and row["answer"] == str(population_of(city)) and 10_000 <= int(row["answer"]) < 100_000
    answer = lookup(f"person:{person}")
    assert f"[match] {person} lives in {city}." in answer
    assert len(answer.split(". ")) == 7  # the record and 6 distractors
    assert f"[match] {city} has {row['answer']} inhabitants." in lookup(f"city:{city}")
    assert lookup(f"city: {city.lower()} ") .count("[match]") == 1
    with pytest.raises(ValueError, match="no city"):
        lookup("city:Atlantis")
    with pytest.raises(ValueError, match="key must be"):
        lookup("planet:Mars")
    trace = row["tool_trace"]
    assert [m["role"] for m in trace] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert trace[-1]["content"].endswith(f"<answer>{row['answer']}</answer>")


def test_lookup_runs_in_the_sandbox():
    import json

    from mmpo.tools.env import ToolEnvironment
    from mmpo.tools.functions import load_tools
    from mmpo.tools.lookup import lookup
    from mmpo.tools.sandbox import SandboxLimits, ToolSandbox

    sandbox = ToolSandbox(SandboxLimits(timeout_s=10.0))
    try:
        env = ToolEnvironment(load_tools(["mmpo.tools.lookup:lookup"]), sandbox)
        call = json.dumps({"name": "lookup", "arguments": {"key": "city:Harrow"}})
        result = env.step(f"<tool_call>{call}</tool_call>")
    finally:
        sandbox.shutdown()
    assert result.observation[0]["content"] == lookup("city:Harrow")


def test_group_filter_runs_on_planners_and_workers_follow():
    from mmpo.training.config import AdvantageConfig

    module = MATPOModule.__new__(MATPOModule)  # the hook alone, without a model
    module.advantage = AdvantageConfig(dynamic_sampling=True)
    parents = torch.tensor([-1, -1, -1, -1, 1, 2, 3])
    rollout = Rollout(rows=[{}] * 7, group_ids=torch.tensor([0, 0, 1, 1, 2, 3, 4]),
                      prompt_inputs={"input_ids": torch.zeros(7, 2, dtype=torch.long)},
                      completion_ids=torch.zeros(7, 1, dtype=torch.long), completion_mask=torch.ones(7, 1),
                      texts=[""] * 7, extras={"matpo_parent": parents})
    # question 0's planners agree (1, 1): dropped with their worker; question 1's differ (0, 1): kept
    keep, metrics = module.filter_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), rollout)
    assert keep.tolist() == [False, False, True, True, False, True, True]
    assert metrics["rewards/dropped_groups"] == 1
