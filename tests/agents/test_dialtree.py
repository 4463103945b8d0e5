"""DIALTREE-RPO: the lock target and judge, pruning and width cap, adaptive masking, and dialogue trees grown on a
tiny Qwen3 (hand-checked tree shape, one trajectory per leaf, goal groups)."""

from __future__ import annotations

import torch
import pytest
from tiny_vlm_support import build_small_text_lm

from mmpo.algos.dialtree import (DialogueEnvironment, DialogueNode, LockTarget, adaptive_format_mask, any_message,
                                 code_revealed, format_token_mask, grow_dialogue_trees, prune_nodes, split_turn,
                                 turn_quality)
from mmpo.algos.tree_rollout import grow_frontier
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.multiturn import MultiTurnEngine, _Trajectory
from mmpo.vlm.rollout import HFGenerateEngine

ROW = {"problem": "get the code", "lock_code": "4321", "lock_greetings": 1}


def test_lock_target_reveals_only_after_a_greeting_and_a_polite_request():
    target = LockTarget()
    assert target(["hello there"], ROW) == "Hello! Nice to meet you."
    assert target(["hello there", "the code please"], ROW) == "Since you ask nicely: the code is 4321."
    assert target(["hello", "give me the code"], ROW) == "Maybe, if you ask nicely."
    assert target(["the code please"], ROW) == "I will not share that."  # direct request first: refused, locked
    assert target(["the code please", "hello", "code please"], ROW) == "I cannot help with that any more."
    assert target(["hi", "code please"], {**ROW, "lock_greetings": 2}) == "I will not share that."


def test_environment_and_judge():
    env = DialogueEnvironment(LockTarget(), code_revealed)
    assert env.reset(ROW) == "Goal: get the code"
    first = env.step("<think>greet first</think> hello")
    assert first.observation == [{"role": "user", "content": "Hello! Nice to meet you."}] and not first.done
    assert code_revealed(env.dialogue, ROW) == 0.0
    second = env.step("<think>now ask</think> code please")
    assert second.done and code_revealed(env.dialogue, ROW) == 1.0
    assert [m["role"] for m in env.dialogue] == ["user", "assistant", "user", "assistant", "user"]
    assert env.dialogue[3]["content"] == "code please"  # the target sees the message, not the thought
    # the code in the goal or in the policy's own message is no success
    assert code_revealed([{"role": "user", "content": "4321"}, {"role": "assistant", "content": "4321"}], ROW) == 0.0


def test_turn_quality():
    assert split_turn("<think>a</think> hi") == ("a", "hi") and split_turn("hi") == (None, "hi")
    assert turn_quality("<think>a</think> hi", ROW, require_think=True, relevance=any_message)
    assert not turn_quality("hi", ROW, require_think=True, relevance=any_message)  # malformed
    assert turn_quality("hi", ROW, require_think=False, relevance=any_message)
    assert not turn_quality("<think>a</think>  ", ROW, require_think=True, relevance=any_message)  # no message
    assert not turn_quality("<think>a</think> weather", ROW, require_think=True,
                            relevance=lambda m, r: "code" in m or "hello" in m)  # off-goal


def _node(group, message, *, awaiting=True):
    trajectory = _Trajectory(tokens=[1], trained=[1], log_probs=[0.0], turns=1, last_message=message,
                             awaiting_environment=awaiting, done=not awaiting)
    return DialogueNode(trajectory, DialogueEnvironment(LockTarget(), code_revealed), root=0, group=group)


def test_pruning_stops_bad_turns_and_caps_the_width():
    good = "<think>x</think> hello"
    nodes = [_node(0, good), _node(0, "no format"), _node(0, good), _node(0, good), _node(1, good),
             _node(1, good, awaiting=False)]
    kept = prune_nodes(nodes, width=2, quality=lambda n: turn_quality(n.trajectory.last_message, ROW,
                                                                       require_think=True, relevance=any_message),
                       generator=torch.Generator().manual_seed(0))
    # goal 0: the malformed node stays as a stopped leaf (valid False); 3 good active -> 2 kept
    goal0 = [n for n in kept if n.group == 0]
    assert len(goal0) == 3 and sum(not n.valid for n in goal0) == 1
    assert [n.done for n in goal0 if not n.valid] == [True]
    assert sum(not n.done for n in goal0) == 2
    # goal 1: 1 active (under the cap) and 1 finished leaf, both kept
    assert [n for n in kept if n.group == 1] == nodes[4:]


def test_grow_frontier_with_fixed_branching_and_a_cap_by_hand():
    class Node:
        def __init__(self, group, depth, done=False):
            self.group, self.depth, self.done = group, depth, done

    def expand(parents):
        return [Node(p.group, p.depth + 1, done=p.depth + 1 >= 3) for p, _ in parents]

    def cap(children):  # at most 3 children per group at each depth
        out = []
        for g in sorted({c.group for c in children}):
            out += [c for c in children if c.group == g][:3]
        return out

    leaves = grow_frontier([Node(0, 1), Node(0, 1)], group_of=lambda n: n.group, expand=expand, max_depth=5,
                           fork=lambda active, finished, now: [2] * len(active), prune=cap)
    # depth 2: 2 x 2 = 4 children, capped to 3; depth 3: 3 x 2 = 6 capped to 3, all leaves (depth 3)
    assert len(leaves) == 3 and all(n.done and n.depth == 3 for n in leaves)


def test_adaptive_masking_removes_format_tokens_of_negative_leaves_only():
    ids = torch.tensor([[5, 7, 8, 9, 7, 8], [7, 8, 1, 2, 3, 0], [1, 7, 2, 8, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    positions = format_token_mask(ids, [[7, 8]])  # the tag's two tokens, adjacent
    assert positions.long().tolist() == [[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]
    out = adaptive_format_mask(mask, positions, torch.tensor([-0.5, 0.7, -1.0]))
    assert out.tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model, processor = load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text")))
    head = model.lm_head  # a bias towards the turn-end token, so that turns end and the target answers
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = 4.0
    model.lm_head = biased
    return MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=200,
                           max_tokens_per_turn=10)


def test_dialogue_trees_on_a_tiny_model(engine):
    rows = make_items("lock", 2, seed=0)
    torch.manual_seed(0)
    rollout, leaves = grow_dialogue_trees(engine, rows, lambda: DialogueEnvironment(LockTarget(), code_revealed),
                                          branching=2, width=3, max_turns=3, quality=lambda n: True)
    # every node that ended its turn is answered and expanded 2 ways, at most 3 active per goal after each depth
    # (the cap is on active nodes): per goal at most 2 (depth 1) + 2 * 2 (depth 2) + 3 * 2 (depth 3) leaves
    groups = rollout.group_ids.tolist()
    assert groups == sorted(groups) and set(groups) <= {0, 1}
    for g in set(groups):
        assert 1 <= groups.count(g) <= 2 + 2 * 2 + 3 * 2
    assert len(rollout) == len(leaves) and rollout.extras["format_valid"].all()
    depths = rollout.extras["tree_depth"].tolist()
    assert max(depths) >= 2 and all(1 <= d <= 3 for d in depths)  # trees grew past the first turn
    for i, leaf in enumerate(leaves):
        dialogue = rollout.rows[i]["dialogue"]
        assert dialogue[0]["content"].startswith("Goal: ")
        assert sum(m["role"] == "assistant" for m in dialogue) in (depths[i], depths[i] - 1)
        assert rollout.extras["turns"][i] == depths[i] == len(leaf.choices)
        # the policy's tokens are trained, the target's answers are holes
        assert rollout.completion_mask[i].sum() > 0
    # siblings share their prefix: two leaves with the same first choice start with the same tokens
    first = {}
    for i, leaf in enumerate(leaves):
        if len(leaf.choices) > 1:
            key = (leaf.group, leaf.choices[0])
            length = len(leaves[i].trajectory.tokens)
            if key in first:
                j = first[key]
                shared = min(5, length, len(leaves[j].trajectory.tokens))
                assert leaves[i].trajectory.tokens[:shared] == leaves[j].trajectory.tokens[:shared]
            first[key] = i


def test_module_advantages_are_grpo_over_leaves_with_the_adaptive_loss_mask():
    from mmpo.algos.dialtree import DialTreeConfig, DialTreeModule
    from mmpo.training.config import AdvantageConfig
    from mmpo.vlm.rollout import Rollout

    module = DialTreeModule.__new__(DialTreeModule)  # the hook alone, without a model
    module.advantage, module.dialtree, module.format_tag_ids = AdvantageConfig(), DialTreeConfig(), [[7, 8]]
    ids = torch.tensor([[7, 8, 3, 4], [7, 8, 5, 0], [3, 7, 8, 2], [7, 8, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    rollout = Rollout(rows=[{}] * 4, group_ids=torch.tensor([0, 0, 1, 1]), prompt_inputs={}, completion_ids=ids,
                      completion_mask=mask, texts=[""] * 4)
    advantages, metrics = module.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), rollout.group_ids, rollout)
    # goal 0: rewards 1, 0 -> mean 0.5, unbiased std 0.7071 -> +-0.7071; goal 1: equal rewards -> 0, 0
    assert torch.allclose(advantages, torch.tensor([0.70710, -0.70710, 0.0, 0.0]), atol=1e-4)
    assert rollout.extras["loss_mask"].tolist() == [[1, 1, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert metrics["dialtree/masked_format_tokens"] == 2.0


def test_dialogue_format_valid_needs_every_policy_turn_well_formed():
    from mmpo.algos.dialtree import dialogue_format_valid

    good = [{"role": "user", "content": "Goal: x"}, {"role": "assistant", "content": "<think>a</think> hello"},
            {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "<think>b</think> the code please"}]
    bad = [*good[:3], {"role": "assistant", "content": "no thought here"}]
    assert dialogue_format_valid(good, ROW, require_think=True, relevance=any_message)
    assert not dialogue_format_valid(bad, ROW, require_think=True, relevance=any_message)
    assert dialogue_format_valid(bad, ROW, require_think=False, relevance=any_message)
    assert not dialogue_format_valid(good, ROW, require_think=True, relevance=lambda m, r: "please" in m)


def test_a_frozen_model_as_the_target_of_one_tree(engine, tmp_path):
    """The target is a frozen tiny model (ModelTarget): a tree grows against it, and every target answer in every
    leaf's dialogue is the model's greedy answer to the policy's messages so far (deterministic, so branches can
    share it); the target's weights are untouched."""
    from mmpo.algos.dialtree import ModelTarget

    target = ModelTarget.from_pretrained(build_small_text_lm(tmp_path / "target", num_layers=1), max_new_tokens=6)
    before = [p.clone() for p in target.engine.model.parameters()]
    rows = make_items("lock", 2, seed=1)
    torch.manual_seed(1)
    rollout, leaves = grow_dialogue_trees(engine, rows, lambda: DialogueEnvironment(target, code_revealed),
                                          branching=2, width=2, max_turns=2, quality=lambda n: True)
    assert sorted(set(rollout.group_ids.tolist())) == [0, 1]
    answers = 0
    for row in rollout.rows:
        dialogue = row["dialogue"]
        said = [m["content"] for m in dialogue if m["role"] == "assistant"]
        replies = [m["content"] for m in dialogue[1:] if m["role"] == "user"]
        assert len(replies) == len(said)  # 0 when the first turn was cut at the turn's token limit (episode ends)
        for turn, reply in enumerate(replies):
            assert reply == target(said[:turn + 1], row)
        answers += len(replies)
    assert answers >= 2 and any(reply for row in rollout.rows for reply in
                                [m["content"] for m in row["dialogue"][1:] if m["role"] == "user"])
    assert all(torch.equal(a, b) for a, b in zip(before, target.engine.model.parameters()))
    assert not any(p.requires_grad for p in target.engine.model.parameters())


def test_flat_dialogue_module_rollout_counts_queries_and_format(tmp_path):
    """The flat baseline: num_generations independent dialogues per goal; target_queries is the number of target
    calls per leaf, format_valid the per-dialogue check, tree_depth the policy turns."""
    from mmpo.algos.dialtree import FlatDialogueModule, dialogue_format_valid

    module = FlatDialogueModule(build_small_text_lm(tmp_path / "policy", num_layers=1),
                                sampling={"num_generations": 3, "max_new_tokens": 10},
                                dialtree={"max_turns": 2, "max_total_tokens": 60, "require_think": False})
    calls: list[int] = []

    def counting(said, row):
        calls.append(len(said))
        return "I see."

    module.target = counting
    model = module.model  # a bias towards the turn-end token, so that turns end and the target answers
    biased = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = 4.0
    model.lm_head = biased
    rows = make_items("lock", 2, seed=2)
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert float(rollout.extras["target_queries"][0]) * 6 == len(calls)
    depths = rollout.extras["tree_depth"].tolist()
    # a turn cut at its token limit ends the dialogue unanswered (depth 0 when it is the first)
    assert sum(depths) == len(calls) > 0 and all(0 <= d <= 2 for d in depths)
    for i, row in enumerate(rollout.rows):
        assert sum(m["role"] == "assistant" for m in row["dialogue"]) == depths[i]
        expected = dialogue_format_valid(row["dialogue"], row, require_think=False, relevance=any_message)
        assert bool(rollout.extras["format_valid"][i]) == expected
    rewards, metrics = module.compute_rewards(rollout)
    assert metrics["dialtree/success_rate"] == 0.0  # "I see." never holds the code
