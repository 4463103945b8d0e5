"""Continuous batching across turns (``MultiTurnEngine(schedule="continuous")``, the default): a trajectory whose turn
ends gets the environment's answer prefilled onto its own cache row and starts its next turn while the others keep
decoding. Greedy decoding gives the same tokens, masks, log-probs (within 1e-5), turn counts, tool counts and
transcripts as the turn-synchronous engine (``schedule="turns"``, which re-prefills each turn with HF ``generate``
when greedy) on a tiny Qwen3 and on a tiny Qwen2.5-VL whose tool answers are images, with the trajectories' turns
ending at different steps; the decoder then runs exactly 1 + (the longest trajectory's model tokens) forwards. One
sampled trajectory draws the same tokens from the same RNG state as the turn-synchronous engine."""

from __future__ import annotations

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, VariedAnswers, VariedCrops, biased_turn_end_head
from tiny_vlm_support import build_small_text_lm, build_small_vlm

from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask
from mmpo.vlm.rollout import HFGenerateEngine


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory):
    return biased_turn_end_head(*load_vlm(build_small_text_lm(tmp_path_factory.mktemp("text"))), eos_bias=1.0,
                                eos_row_scale=2.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return biased_turn_end_head(*load_vlm(build_small_vlm(tmp_path_factory.mktemp("vlm"))), eos_bias=-4.0,
                                eos_row_scale=2.0, seed=2)


CASES = {
    # name: (policy fixture, task, environment, max_tokens_per_turn, max_total_tokens)
    "text": ("text_lm", "long_arithmetic", VariedAnswers, 24, 300),
    "text_cut": ("text_lm", "long_arithmetic", lambda salt: VariedAnswers(salt, 10), 3, 40),  # budgets cut
    "vlm_images": ("vlm", "zoom", VariedCrops, 24, 300),
}


class _ForwardCounter:
    """Counts the text decoder's forwards (calls of its first layer): decode steps (one token wide) and prefills."""

    def __init__(self, model):
        self.decode_steps = self.prefills = 0
        self.handle = getattr(model.model, "language_model", model.model).layers[0].register_forward_pre_hook(
            self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == 1:
            self.decode_steps += 1
        else:
            self.prefills += 1


def _rollout(policy, case, schedule, *, rows=4, num_samples=1, do_sample=False, seed=0, **sampling):
    model, processor = policy
    _, task, environment, per_turn, total = case
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=total,
                             max_tokens_per_turn=per_turn, schedule=schedule)
    counter = _ForwardCounter(model)
    try:
        torch.manual_seed(seed)
        rollout = engine.generate(make_items(task, rows, seed=0), [environment(salt) for salt in range(rows * num_samples)],
                                  num_samples=num_samples, do_sample=do_sample, **sampling)
    finally:
        counter.handle.remove()
    return rollout, engine, counter


def _model_runs(rollout, i):
    """[(start, end)] of trajectory ``i``'s model turns."""
    mask, attention = rollout.completion_mask[i], completion_attention_mask(rollout)[i]
    runs, start = [], None
    for position in range(int(attention.sum()) + 1):
        trained = position < int(attention.sum()) and bool(mask[position])
        if trained and start is None:
            start = position
        elif not trained and start is not None:
            runs.append((start, position))
            start = None
    return runs


def _assert_same(continuous, turns):
    assert torch.equal(continuous.completion_ids, turns.completion_ids)
    assert torch.equal(continuous.completion_mask, turns.completion_mask)
    assert torch.equal(completion_attention_mask(continuous), completion_attention_mask(turns))
    torch.testing.assert_close(continuous.extras["engine_log_probs"], turns.extras["engine_log_probs"], atol=1e-5,
                               rtol=0)
    for key in ("turns", "tool_calls", "env_rewards"):
        assert torch.equal(continuous.extras[key], turns.extras[key]), key
    assert continuous.texts == turns.texts
    assert continuous.group_ids.tolist() == turns.group_ids.tolist()
    for key in ("input_ids", "attention_mask", "image_grid_thw", "tool_image_counts"):
        if key in turns.prompt_inputs:
            assert torch.equal(continuous.prompt_inputs[key], turns.prompt_inputs[key]), key


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_continuous_batching_equals_the_turn_synchronous_engine(name, request):
    case = CASES[name]
    policy = request.getfixturevalue(case[0])
    continuous, continuous_engine, continuous_forwards = _rollout(policy, case, "continuous")
    turns, turns_engine, _ = _rollout(policy, case, "turns")
    assert continuous_engine.last_schedule == "continuous" and turns_engine.last_schedule == "turns"
    _assert_same(continuous, turns)
    assert continuous_engine.last_transcripts == turns_engine.last_transcripts
    # the case is not trivial: later turns ran, and the trajectories' turns ended at different steps, so some
    # trajectories prefilled tool answers while others were still decoding
    runs = [_model_runs(continuous, i) for i in range(len(continuous))]
    assert max(continuous.extras["turns"].tolist()) >= 2
    assert len({tuple(end - start for start, end in r) for r in runs}) > 1
    if name == "text_cut":  # some trajectory ended on a budget (a cut turn: it ends without the turn-end token)
        eos = continuous_engine.engine.eos_token_id
        assert any(continuous.completion_ids[i, r[-1][1] - 1] != eos for i, r in enumerate(runs))
    if name == "vlm_images":
        assert continuous.prompt_inputs["tool_image_counts"].tolist() == [2, 2, 2, 2]
    # one step per model token of the longest trajectory; prefills: the prompts once, then at most one per step at
    # which turns started (the trajectories starting a turn at that step together)
    model_tokens = continuous.completion_mask.sum(-1)
    assert continuous_forwards.decode_steps == int(model_tokens.max())
    assert 2 <= continuous_forwards.prefills <= 1 + int((continuous.extras["turns"] - 1).sum())
    # the tool answers were prefilled, each once, onto the kept cache rows
    holes = int((completion_attention_mask(continuous) - continuous.completion_mask).sum())
    assert continuous_engine.last_prefill_tokens == holes


@pytest.mark.parametrize("name,sampling", [("text", {}), ("text", {"temperature": 0.7, "top_p": 0.9}),
                                           ("vlm_images", {})])
def test_one_sampled_trajectory_draws_the_turn_synchronous_tokens(name, sampling, request):
    """One trajectory: both schedules draw one multinomial sample per step from the same RNG state (after the same
    temperature and top-p warpers)."""
    case = CASES[name]
    policy = request.getfixturevalue(case[0])
    for seed in (0, 1):
        continuous, engine, _ = _rollout(policy, case, "continuous", rows=1, do_sample=True, seed=seed, **sampling)
        turns, _, _ = _rollout(policy, case, "turns", rows=1, do_sample=True, seed=seed, **sampling)
        assert engine.last_schedule == "continuous" and int(continuous.extras["turns"][0]) >= 2
        _assert_same(continuous, turns)


def test_min_new_tokens_holds_in_every_turn(text_lm):
    """The generation config's ``min_new_tokens`` bans the turn end within each turn's first tokens, as HF ``generate``
    does per turn in the turn-synchronous schedule."""
    model, _ = text_lm
    model.generation_config.min_new_tokens = 3
    try:
        continuous, engine, _ = _rollout(text_lm, CASES["text"], "continuous")
        turns, _, _ = _rollout(text_lm, CASES["text"], "turns")
    finally:
        model.generation_config.min_new_tokens = None
    assert engine.last_schedule == "continuous"
    _assert_same(continuous, turns)
    runs = [_model_runs(continuous, i) for i in range(len(continuous))]
    assert max(continuous.extras["turns"].tolist()) >= 2
    assert all(end - start >= 3 for r in runs for start, end in r)


def test_sampled_groups_score_like_the_training_forward(text_lm):
    """Many trajectories sampled at temperature 0.7 and top-p 0.9: each token's log-prob is the training forward's
    over the compact conversation (the right context and positions), and groups stay contiguous."""
    model, processor = text_lm
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=120,
                             max_tokens_per_turn=16)
    torch.manual_seed(3)
    rollout = engine.generate(make_items("long_arithmetic", 3, seed=0), [ScriptedEnvironment() for _ in range(12)],
                              num_samples=4, temperature=0.7, top_p=0.9)
    assert engine.last_schedule == "continuous"
    assert rollout.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert max(rollout.extras["turns"].tolist()) == 3
    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention,
                                            temperature=0.7)
    trained = rollout.completion_mask.bool()
    sampled = rollout.extras["engine_log_probs"][trained]
    # top-p renormalises the kept tokens: the sampler's log-prob is the forward's minus log(kept mass) <= 0
    assert (sampled >= log_probs[trained] - 1e-4).all()
    full = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=120,
                           max_tokens_per_turn=16)
    torch.manual_seed(3)
    plain = full.generate(make_items("long_arithmetic", 3, seed=0), [ScriptedEnvironment() for _ in range(12)],
                          num_samples=4, temperature=0.7)
    attention = completion_attention_mask(plain)
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, plain.prompt_inputs, plain.completion_ids, attention,
                                            temperature=0.7)
    trained = plain.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], plain.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)


def test_the_turn_schedule_where_the_lean_loop_does_not_apply(text_lm):
    model, processor = text_lm
    engine = MultiTurnEngine(HFGenerateEngine(model, processor, lean_decode=False), max_turns=2,
                             max_total_tokens=60, max_tokens_per_turn=8)
    engine.generate(make_items("long_arithmetic", 1, seed=0), [ScriptedEnvironment()], num_samples=1)
    assert engine.last_schedule == "turns: lean_decode=False"
    with pytest.raises(ValueError, match="schedule"):
        MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=2, max_total_tokens=60, max_tokens_per_turn=8,
                        schedule="async")
