"""ARPO (arXiv 2507.19849): the entropy probe and the branching rule against the official code on fixed inputs,
hand values of the fork probability and of the hard advantage attribution, and the branching rollout on a tiny Qwen3
(exactly n trajectories per prompt in contiguous groups, forks that copy the tool answers, log-probs equal to the
training forward, no forks at alpha = 0, the full budget by forks at alpha = 1)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, trainer_segment_entropies
from tiny_vlm_support import build_small_text_lm

from mmpo.algos.arpo import (ARPOConfig, ARPOEngine, _EntropyProbe, branch_decisions, branch_probability,
                             pooled_entropy, shared_prefix_advantages, top_logprob_entropy)
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import completion_attention_mask
from mmpo.vlm.rollout import HFGenerateEngine

# ----------------------------------------------------------------------------------------------------------------
# Reference: transcribed from dongguanting/ARPO @ e257337,
# ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py
# (vLLMRolloutWithTools._calc_entropy, and the "Entropy Variation Monitoring" and "Apply beam search" blocks of
# generate_sequences), wrapped as functions of their inputs; `random.random` is passed in as `rand`.


def official_calc_entropy(logprobs):
    if not logprobs:
        return 0.0
    p_list = [math.exp(l) for l in logprobs]
    entropy = -sum(p * l for p, l in zip(p_list, logprobs))
    return entropy


def official_segment_entropy(output_logprobs, tokens, vocab_size):
    entropy_norm_factor = math.log(vocab_size)
    logprobs = []
    for j in range(min(20, len(tokens))):
        try:
            logprob_info = output_logprobs[j]
        except Exception:
            logprob_info = output_logprobs[-1]
        token_list = list(logprob_info.values())
        token_logprobs = [token.logprob for token in token_list]
        logprobs.extend(token_logprobs)
    if logprobs:
        entropy = official_calc_entropy(logprobs) / entropy_norm_factor
    else:
        entropy = 0.0
    return entropy


def official_branching(final_active_indices, sample_to_indices, rollouts_per_sample, num_samples, beam_size,
                       current_entropy_dict, initial_entropy_dict, entropy_weight, branch_probability, rand):
    new_sources = []
    new_sample_origins = []
    active_by_sample = {}
    for idx in final_active_indices:
        orig_sample = None
        for sample_idx, indices in sample_to_indices.items():
            if idx in indices:
                orig_sample = sample_idx
                break
        if orig_sample is not None:
            if orig_sample not in active_by_sample:
                active_by_sample[orig_sample] = []
            active_by_sample[orig_sample].append(idx)
    for orig_sample, active_idxs in active_by_sample.items():
        remaining_slots = num_samples - rollouts_per_sample[orig_sample]
        if remaining_slots <= 0:
            continue
        branches_created = 0
        for source_idx in active_idxs:
            branches_per_idx = min(beam_size - 1, remaining_slots - branches_created)
            if branches_per_idx <= 0:
                break
            for _ in range(branches_per_idx):
                entropy_now = current_entropy_dict.get(source_idx, 0.0)
                entropy_init = initial_entropy_dict.get(source_idx, 0.0)
                entropy_delta = entropy_now - entropy_init
                prob = rand() - entropy_weight * entropy_delta
                prob = max(0.0, min(1.0, prob))
                if prob > branch_probability:
                    continue
                new_sources.append(source_idx)
                new_sample_origins.append(orig_sample)
                rollouts_per_sample[orig_sample] += 1
                branches_created += 1
            if branches_created >= remaining_slots:
                break
    return list(zip(new_sample_origins, new_sources)), active_by_sample

# ----------------------------------------------------------------------------------------------------------------


def test_pooled_entropy_hand_values():
    assert pooled_entropy([math.log(0.5), math.log(0.25)]) == pytest.approx(math.log(2))
    assert pooled_entropy([]) == 0.0
    assert pooled_entropy([0.0, -math.inf]) == 0.0  # p = 1 contributes 0; p = 0 contributes 0
    values = [-0.1, -2.3, -4.0, -7.5]
    assert pooled_entropy(values) == pytest.approx(official_calc_entropy(values), abs=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_probe_equals_the_official_entropy_of_vllm_top10_logprobs(seed):
    """Fixed logits for 3 rows x 25 steps over a 50-token vocabulary; the official code reads vLLM's logprobs=10
    dicts (the top 10, plus the sampled token when it is not among them); the probe sees the same scores."""
    generator = torch.Generator().manual_seed(seed)
    rows, steps, vocab = 3, 25, 50
    scores = torch.randn(steps, rows, vocab, generator=generator) * 2.0
    sampled = torch.randint(0, vocab, (rows, steps), generator=generator)
    lengths = [25, 7, 0]
    probe = _EntropyProbe(top_k=10, window=20)
    input_ids = torch.zeros(rows, 1, dtype=torch.long)
    for step in range(steps):
        probe(input_ids, scores[step])
        input_ids = torch.cat([input_ids, sampled[:, step:step + 1]], 1)
    log_probs = probe.finish(input_ids)
    drawn = [sampled[r, :lengths[r]].tolist() for r in range(rows)]
    mine = probe.segment_entropies(drawn, [log_probs[r, :lengths[r]].tolist() for r in range(rows)], vocab)
    for r in range(rows):
        outputs = []
        for step in range(lengths[r]):
            full = torch.log_softmax(scores[step, r].float(), -1)
            values, indices = full.topk(10)
            entry = {int(i): SimpleNamespace(logprob=float(v)) for v, i in zip(values, indices)}
            entry.setdefault(int(sampled[r, step]), SimpleNamespace(logprob=float(full[sampled[r, step]])))
            outputs.append(entry)
        assert mine[r] == pytest.approx(official_segment_entropy(outputs, drawn[r], vocab), rel=1e-5, abs=1e-7)
    assert mine[2] == 0.0 and mine[0] > 0


def test_top_logprob_entropy_hand_value_and_the_official_segment_entropy():
    """The entropy of vLLM's returned top log-probs (the vLLM engine's probe): a hand value, and the official entropy
    block on logprobs=10 dictionaries (11 entries where the sampled token is not in the top 10) over 25, 7 and 1
    positions (the window keeps the first 20)."""
    # one position {a: ln 0.5, b: ln 0.25}, |V| = 4: (0.5 ln 2 + 0.25 ln 4) / ln 4 = ln 2 / ln 4 = 0.5
    assert top_logprob_entropy([{3: math.log(0.5), 7: math.log(0.25)}], window=20, vocab_size=4) == pytest.approx(0.5)
    assert top_logprob_entropy([], window=20, vocab_size=4) == 0.0
    generator = torch.Generator().manual_seed(0)
    for length in (25, 7, 1):
        top = []
        for _ in range(length):
            full = torch.log_softmax(torch.randn(50, generator=generator) * 2.0, -1)
            values, indices = full.topk(10)
            entry = {int(i): float(v) for v, i in zip(values, indices)}
            sampled = int(torch.randint(0, 50, (1,), generator=generator))
            entry.setdefault(sampled, float(full[sampled]))
            top.append(entry)
        outputs = [{token: SimpleNamespace(logprob=value) for token, value in entry.items()} for entry in top]
        official = official_segment_entropy(outputs, [0] * length, 50)
        assert official > 0
        assert top_logprob_entropy(top, window=20, vocab_size=50) == pytest.approx(official, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_branch_decisions_equal_the_official_branching(seed):
    rng = random.Random(seed)
    num_samples, beam_size = rng.choice([(4, 2), (8, 3), (6, 2)])
    batch = 3
    counts = [rng.randint(1, num_samples) for _ in range(batch)]
    sample_to_indices, next_index = {}, 0
    for sample in range(batch):
        sample_to_indices[sample] = list(range(next_index, next_index + counts[sample]))
        next_index += counts[sample]
    final_active = sorted(rng.sample(range(next_index), k=rng.randint(0, next_index)))
    rng.shuffle(final_active)
    now = {i: rng.random() for i in range(next_index)}
    init = {i: rng.random() for i in range(next_index) if rng.random() < 0.7}
    alpha, beta = rng.choice([0.5, 0.3, 0.9]), rng.choice([0.2, 0.5, 2.0])
    official_counts = list(counts)
    expected, active_by_sample = official_branching(final_active, sample_to_indices, official_counts, num_samples,
                                                    beam_size, now, init, beta, alpha, random.Random(seed + 100).random)
    mine_counts = list(counts)
    mine = branch_decisions(active_by_sample, mine_counts, num_samples=num_samples, beam_size=beam_size, alpha=alpha,
                            beta=beta, entropy_now=now, entropy_init=init, uniform=random.Random(seed + 100).random)
    assert mine == expected
    assert mine_counts == official_counts


def test_fork_probability_is_clip_of_alpha_plus_beta_dh():
    assert branch_probability(1.0, alpha=0.5, beta=0.2) == pytest.approx(0.7)
    assert branch_probability(-5.0, alpha=0.5, beta=0.2) == 0.0
    assert branch_probability(5.0, alpha=0.5, beta=0.2) == 1.0
    # Monte Carlo: 20,000 single tries of one active trajectory, dH = 1 -> forks at rate 0.7
    draws = random.Random(0)
    forks = 0
    for _ in range(20000):
        counts = [1]
        forks += len(branch_decisions({0: [0]}, counts, num_samples=2, beam_size=2, alpha=0.5, beta=0.2,
                                      entropy_now={0: 1.5}, entropy_init={0: 0.5}, uniform=draws.random))
    assert forks / 20000 == pytest.approx(0.7, abs=0.015)


def test_hard_attribution_averages_over_the_trajectories_sharing_a_prefix():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [1, 2, 3, 0]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    out = shared_prefix_advantages(torch.tensor([1.0, 0.0, -1.0]), ids, attention, torch.tensor([0, 0, 0]))
    assert out.tolist() == [[0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]]
    # other groups never mix in: the same tokens in another group keep their own advantage
    out = shared_prefix_advantages(torch.tensor([1.0, 0.0]), ids[:2], attention[:2], torch.tensor([0, 1]))
    assert out.tolist() == [[1.0] * 4, [0.0] * 4]


def test_config_refuses_bad_settings():
    for bad in (dict(initial_rollouts=0), dict(branch_probability=1.5), dict(attribution="x"),
                dict(initial_entropy="x"), dict(beam_size=True)):
        with pytest.raises(ValueError, match="arpo\\."):
            ARPOConfig(**bad)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, processor = load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text")))
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = 9.0  # every turn ends well within its budget
    model.lm_head = biased
    return model.eval(), processor


def _engine(policy, **settings):
    model, processor = policy
    return ARPOEngine(HFGenerateEngine(model, processor), ARPOConfig(**settings), max_turns=3, max_total_tokens=200,
                      max_tokens_per_turn=24)


def test_always_forking_fills_the_budget_with_branches_that_copy_the_tool_answers(policy):
    engine = _engine(policy, initial_rollouts=1, beam_size=2, branch_probability=1.0)
    rows = make_items("long_arithmetic", 2, seed=0)
    torch.manual_seed(0)
    rollout = engine.generate(rows, [ScriptedEnvironment() for _ in range(8)], num_samples=4)
    # per prompt: 1 global trajectory; round 1 forks it (2); round 2 forks both (4); round 3 ends them
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.last_stats["arpo/forks"] == 6.0 and engine.last_stats["arpo/topups"] == 0.0
    assert engine.last_stats["arpo/forked_frac"] == 0.75
    assert rollout.extras["turns"].tolist() == [3] * 8 and rollout.extras["tool_calls"].tolist() == [2] * 8
    assert [r["id"] for r in rollout.rows] == [rows[0]["id"]] * 4 + [rows[1]["id"]] * 4
    attention = completion_attention_mask(rollout)
    for group in (0, 4):
        first, fork = rollout.completion_ids[group], rollout.completion_ids[group + 1]
        holes = torch.nonzero((rollout.completion_mask[group] == 0) & (attention[group] == 1)).flatten()
        end_of_first_answer = int(holes[0]) + 1
        while rollout.completion_mask[group, end_of_first_answer] == 0:
            end_of_first_answer += 1
        # the branch made after round 1 holds the first turn and the first tool answer of its source
        assert torch.equal(first[:end_of_first_answer], fork[:end_of_first_answer])
    with torch.no_grad():
        log_probs, _ = completion_log_probs(policy[0], rollout.prompt_inputs, rollout.completion_ids, attention)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
    assert len(engine.last_transcripts) == 8
    # the entropies the branching read, one per model turn (a branch's first turns are its source's), are those of
    # the training forward's top-10 log-probs
    expected = trainer_segment_entropies(policy[0], rollout, temperature=1.0,
                                         vocab_size=len(policy[1].tokenizer.get_vocab()))
    assert [len(e) for e in engine.last_entropies] == [3] * 8
    for mine, theirs in zip(engine.last_entropies, expected):
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_never_forking_tops_up_with_global_trajectories(policy):
    engine = _engine(policy, initial_rollouts=2, beam_size=2, branch_probability=0.0, entropy_weight=0.0)
    torch.manual_seed(1)
    rollout = engine.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment() for _ in range(8)],
                              num_samples=4)
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.last_stats["arpo/forks"] == 0.0 and engine.last_stats["arpo/topups"] == 4.0
    assert engine.last_stats["arpo/forked_frac"] == 0.0
    assert rollout.extras["turns"].tolist() == [3] * 8


def test_initial_entropy_per_rollout_or_persistent_and_the_state_round_trip(policy):
    per_rollout = _engine(policy, initial_rollouts=2, branch_probability=0.5)
    torch.manual_seed(2)
    per_rollout.generate(make_items("long_arithmetic", 1, seed=0), [ScriptedEnvironment() for _ in range(4)],
                         num_samples=4)
    assert per_rollout.persistent_initial_entropy == {}
    persistent = _engine(policy, initial_rollouts=2, branch_probability=0.5, initial_entropy="persistent")
    persistent.generate(make_items("long_arithmetic", 1, seed=0), [ScriptedEnvironment() for _ in range(4)],
                        num_samples=4)
    stored = dict(persistent.persistent_initial_entropy)
    assert set(stored) >= {0, 1} and all(0 <= v <= 1 for v in stored.values())
    persistent.generate(make_items("long_arithmetic", 1, seed=1), [ScriptedEnvironment() for _ in range(4)],
                        num_samples=4)
    assert all(persistent.persistent_initial_entropy[i] == v for i, v in stored.items())  # never overwritten
    state = persistent.state_dict()
    draws = [persistent.rng.random() for _ in range(3)]
    restored = _engine(policy, initial_entropy="persistent")
    restored.load_state_dict(state)
    assert [restored.rng.random() for _ in range(3)] == draws
    assert restored.persistent_initial_entropy == persistent.persistent_initial_entropy


def test_greedy_decoding_does_not_branch(policy):
    engine = _engine(policy, initial_rollouts=1, branch_probability=1.0)
    rollout = engine.generate(make_items("long_arithmetic", 2, seed=0), [ScriptedEnvironment() for _ in range(2)],
                              num_samples=1, do_sample=False)
    assert rollout.group_ids.tolist() == [0, 1] and engine.last_stats == {}


def test_forks_copy_the_environment_through_its_fork_method():
    from mmpo.algos.arpo import _fork_environment

    class Counting(ScriptedEnvironment):
        def fork(self):
            copy = Counting(self.answers)
            copy.steps = self.steps
            copy.forked_from = self
            return copy

    env = Counting()
    env.steps = 1
    fork = _fork_environment(env)
    assert fork.forked_from is env and fork.steps == 1
    fork.step("x")
    assert (env.steps, fork.steps) == (1, 2)  # the copy runs on, the source is untouched
    plain = ScriptedEnvironment()
    plain.steps = 1
    copy = _fork_environment(plain)
    assert copy is not plain and copy.steps == 1


def test_initial_rollouts_are_capped_at_the_budget(policy):
    engine = _engine(policy, initial_rollouts=8, branch_probability=1.0)
    torch.manual_seed(3)
    rollout = engine.generate(make_items("long_arithmetic", 1, seed=0), [ScriptedEnvironment() for _ in range(2)],
                              num_samples=2)
    # 2 global trajectories fill the budget of 2 at once: nothing to branch or top up
    assert rollout.group_ids.tolist() == [0, 0]
    assert engine.last_stats["arpo/forks"] == 0.0 and engine.last_stats["arpo/topups"] == 0.0
