"""bench/bench_multiturn_cost.py: the ratios on hand values, the scripted environment's episode, the turn-end forcing
processor on hand values, and the like-for-like modes on a tiny Qwen3: ``matched`` gives every single-turn completion
its multi-turn trajectory's model tokens, ``fixed`` gives every multi-side turn exactly L tokens and every single-side
completion turns x L."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_vlm_support import build_small_text_lm

from bench_support import load_bench


def test_ratio_summary_per_rollout_and_per_token():
    bench = load_bench("bench_multiturn_cost")
    rounds = [{"multi": {"wall_s": 3.0, "cpu_s": 2.0, "generated_tokens": 100},
               "single": {"wall_s": 2.0, "cpu_s": 1.0, "generated_tokens": 50}},
              {"multi": {"wall_s": 2.4, "cpu_s": 1.2, "generated_tokens": 100},
               "single": {"wall_s": 2.0, "cpu_s": 1.0, "generated_tokens": 100}},
              {"multi": {"wall_s": 1.0, "cpu_s": 1.0, "generated_tokens": 100},
               "single": {"wall_s": 1.0, "cpu_s": 1.0, "generated_tokens": 100}}]
    summary = bench.ratio_summary(rounds)
    assert summary["wall_s"]["per_round"] == pytest.approx([1.5, 1.2, 1.0]) and summary["wall_s"]["median"] == 1.2
    assert summary["cpu_s"]["per_round"] == pytest.approx([2.0, 1.2, 1.0])
    # per generated token: round 0 generated twice the tokens on the multi side: (3/100) / (2/50) = 0.75
    assert summary["wall_s_per_token"]["per_round"] == pytest.approx([0.75, 1.2, 1.0])
    assert summary["cpu_s_per_token"]["median"] == pytest.approx(1.0)


def test_scripted_environment_answers_all_turns_but_the_last():
    bench = load_bench("bench_multiturn_cost")
    env = bench.ScriptedToolEnvironment(answers=2)
    assert env.reset({"problem": "What is 2 + 2?"}) == "What is 2 + 2?"
    first, second, third = env.step("a"), env.step("b"), env.step("c")
    assert first.observation == [{"role": "tool", "content": "result 1"}] and not first.done
    assert second.observation == [{"role": "tool", "content": "result 2"}] and not second.done
    assert third.done and third.observation == []


def test_turn_end_forcing_bans_the_end_before_each_rows_budget_and_forces_it_at_the_budget():
    bench = load_bench("bench_multiturn_cost")
    eos, inf = 2, math.inf
    forcing = bench.TurnEndForcing(eos, [1, 3, 2])
    scores = torch.tensor([[0.5, 1.0, -1.0, 2.0]] * 3)
    prompt = torch.zeros(3, 5, dtype=torch.long)  # 5 prompt tokens: the first call is the first token's
    first = forcing(prompt, scores)
    assert first.tolist() == [[-inf, -inf, 0.0, -inf],  # budget 1: the end now
                              [0.5, 1.0, -inf, 2.0],  # budget 3: 1st of 3, the end banned
                              [0.5, 1.0, -inf, 2.0]]  # budget 2: 1st of 2
    assert scores[0].tolist() == [0.5, 1.0, -1.0, 2.0]  # the input is not changed in place
    second = forcing(torch.zeros(3, 6, dtype=torch.long), scores)
    assert second.tolist() == [[0.5, 1.0, -1.0, 2.0],  # row 0 has ended: left alone
                               [0.5, 1.0, -inf, 2.0],
                               [-inf, -inf, 0.0, -inf]]
    third = forcing(torch.zeros(3, 7, dtype=torch.long), scores)
    assert third.tolist() == [[0.5, 1.0, -1.0, 2.0], [-inf, -inf, 0.0, -inf], [0.5, 1.0, -1.0, 2.0]]
    # the forced token is drawn with probability 1 and log-prob 0
    assert torch.softmax(third[1], -1).tolist() == [0.0, 0.0, 1.0, 0.0]


def test_turn_end_forcing_refuses_empty_budgets_and_a_batch_of_another_size():
    bench = load_bench("bench_multiturn_cost")
    with pytest.raises(ValueError, match="at least 1 token"):
        bench.TurnEndForcing(2, [3, 0])
    with pytest.raises(ValueError, match="2 rows for 3 budgets"):
        bench.TurnEndForcing(2, [1, 2, 3])(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5))


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


def _rollout(bench, path, *, side, mode, **settings):
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(path)
    model = bench.prepare_model(model, side=side, mode=mode, eos_bias=settings.pop("eos_bias", 3.0),
                                turns=settings["turns"], turn_length=settings.pop("turn_length", 0))
    run = bench.make_rollout(model, processor, side=side, mode=mode, prompts=2, samples=3, **settings)
    counts = bench.count_forwards(model)  # as the bench counts them
    torch.manual_seed(0)
    with torch.no_grad():
        result = run()
    result.extras["decoder_forwards"] = counts["forwards"]
    result.extras["prefill_positions"] = counts["prefill_positions"]
    return result, model.generation_config.eos_token_id


def test_matched_mode_gives_each_single_turn_completion_its_trajectorys_model_tokens(tiny_lm):
    bench = load_bench("bench_multiturn_cost")
    multi, eos = _rollout(bench, tiny_lm, side="multi", mode="matched", turns=3, tokens_per_turn=24, eos_bias=4.0)
    lengths = bench.trajectory_tokens(multi)
    assert len(lengths) == 6 and len(set(lengths)) > 1  # the model draws the turn ends: the trajectories differ
    single, _ = _rollout(bench, tiny_lm, side="single", mode="matched", turns=3, tokens_per_turn=24,
                         single_lengths=lengths)
    assert bench.trajectory_tokens(single) == lengths
    assert single.completion_ids.shape[1] == max(lengths)  # the same longest trajectory, so as many decode steps
    # the prompts' prefill, then one step per token of the longest (continuous batching: the multi side too, plus
    # one answer prefill per step where turns end)
    assert single.extras["decoder_forwards"] == 1 + max(lengths)
    assert multi.extras["decoder_forwards"] > 1 + max(lengths)
    for row, length in enumerate(lengths):  # the end-of-turn token exactly at each row's budget, nowhere before
        ids = single.completion_ids[row, :length].tolist()
        assert ids[-1] == eos and eos not in ids[:-1]


def test_fixed_mode_gives_every_turn_l_tokens_and_every_single_completion_turns_times_l(tiny_lm):
    bench = load_bench("bench_multiturn_cost")
    multi, eos = _rollout(bench, tiny_lm, side="multi", mode="fixed", turns=3, tokens_per_turn=24, turn_length=5)
    assert bench.trajectory_tokens(multi) == [15] * 6 and multi.extras["turns"].tolist() == [3] * 6
    for row in range(6):  # the model's tokens (the environment's answers are out of the mask): an end every 5th
        model_tokens = multi.completion_ids[row][multi.completion_mask[row] > 0].tolist()
        assert [i for i, token in enumerate(model_tokens) if token == eos] == [4, 9, 14]
    single, _ = _rollout(bench, tiny_lm, side="single", mode="fixed", turns=3, tokens_per_turn=24, turn_length=5)
    assert bench.trajectory_tokens(single) == [15] * 6
    assert [row.tolist().index(eos) for row in single.completion_ids] == [14] * 6
    # every turn ends at the same step: 1 prompt prefill + 15 steps + 2 answer prefills against 1 + 15
    assert (multi.extras["decoder_forwards"], single.extras["decoder_forwards"]) == (18, 16)
    # the prefills: the 2 prompts (all but their last token) on both sides; on the multi side also each of the 6
    # trajectories' two answers (the chat template's rendering of "result 1" and "result 2" after the turn end)
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.multiturn import encode_observation

    _, processor = load_vlm(tiny_lm)
    answers = [len(encode_observation(processor, [{"role": "tool", "content": f"result {k}"}])[0]) for k in (1, 2)]
    prompt_width = single.prompt_inputs["input_ids"].shape[1]
    assert single.extras["prefill_positions"] == 2 * (prompt_width - 1)
    assert multi.extras["prefill_positions"] == 2 * (prompt_width - 1) + 6 * sum(answers)
