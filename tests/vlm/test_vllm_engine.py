"""The vLLM rollout engine (mmpo.vlm.vllm_engine) on the tiny Qwen2.5-VL.

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/vlm/test_vllm_engine.py

In a venv without vLLM tests/vlm/conftest.py leaves this file out of the collection and says so in
pytest's header (the HF engine's tests always run: tests/vlm/test_rollout.py).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from tiny_vlm_support import tiny_grpo_fit_args

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus, make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_hidden_states
from mmpo.vlm.processing import encode_prompts, repeat_rows, vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.vllm_engine import VLLMEngine

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vlm" / "grpo_tiny_vllm.yaml"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    # the default widths: head_dim 32 (vLLM's CPU attention has no kernel for head_dim 16: "Unsupported CPU
    # attention configuration: head_dim=16")
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400)


@pytest.fixture(scope="module")
def engine(tiny_path):
    """One colocated vLLM engine for the module (building one takes ~20 s on this CPU)."""
    model, processor = load_vlm(tiny_path)
    return VLLMEngine(model, processor, model_path=str(tiny_path), max_model_len=1024, max_num_batched_tokens=4096)


def _rows():
    return make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)


def _sampling_log_probs(model, processor, rollout, temperature):
    """The trainer's log-probs of the sampled tokens under the distribution the engine samples from: the
    trainer's forward on [prompt | completion], logits / temperature, the vision tokens masked to -inf."""
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids,
                                          rollout.completion_mask)
        logits = model.get_output_embeddings()(hidden).float() / temperature
        logits[..., vision_token_ids(processor)] = float("-inf")
        return torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)


def test_prompts_groups_and_seeds(engine):
    rows = _rows()
    torch.manual_seed(0)
    rollout = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["id"] for r in rollout.rows] == [r["id"] for r in rows for _ in range(3)]
    assert rollout.completion_ids.shape == rollout.completion_mask.shape and rollout.completion_ids.shape[0] == 9
    # the trainer's prompt batch, repeated per sample (vLLM's own prompt ids were checked equal to these)
    expected = encode_prompts(engine.processor, rows)
    for key, value in repeat_rows(expected, 3).items():
        assert torch.equal(rollout.prompt_inputs[key], value), key
    assert len({tuple(x) for x in rollout.completion_ids[:3].tolist()}) > 1  # the G samples differ
    # the same torch seed gives the same samples; another seed other ones
    torch.manual_seed(0)
    again = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert torch.equal(again.completion_ids, rollout.completion_ids)
    torch.manual_seed(1)
    other = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert not torch.equal(other.completion_ids, rollout.completion_ids)


def test_log_probs_equal_the_trainers_before_and_after_a_weight_sync(engine):
    model, processor = engine.model, engine.processor
    rows = _rows()
    temperature = 0.7
    torch.manual_seed(3)
    before = engine.generate(rows, num_samples=2, max_new_tokens=8, temperature=temperature, return_log_probs=True)
    mask = before.completion_mask.bool()
    expected = _sampling_log_probs(model, processor, before, temperature)
    torch.testing.assert_close(before.extras["engine_log_probs"][mask], expected[mask], atol=1e-3, rtol=0)
    # an optimizer step on the policy (the trainer's in-place update): the next generate syncs the weights
    syncs = engine.num_syncs
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(4)
    for param in model.parameters():
        param.grad = 0.05 * torch.randn_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    after = engine.generate(rows, num_samples=2, max_new_tokens=8, temperature=temperature, return_log_probs=True)
    assert engine.num_syncs == syncs + 1
    mask = after.completion_mask.bool()
    expected_after = _sampling_log_probs(model, processor, after, temperature)
    torch.testing.assert_close(after.extras["engine_log_probs"][mask], expected_after[mask], atol=1e-3, rtol=0)
    # the step moved the log-probs far beyond the tolerance (on the first rollout's tokens, the new policy
    # against the engine's old log-probs): the sync is what made them agree
    before_mask = before.completion_mask.bool()
    stale = before.extras["engine_log_probs"][before_mask] - _sampling_log_probs(model, processor, before,
                                                                                 temperature)[before_mask]
    assert stale.abs().max() > 1e-2
    # no optimizer step, no sync
    engine.generate(rows[:1], num_samples=2, max_new_tokens=2)
    assert engine.num_syncs == syncs + 1


def test_greedy_matches_hf_generate(engine):
    """Greedy decoding (validation) gives HF generate's tokens: the same prompts, weights and suppression."""
    rows = _rows()
    ours = engine.generate(rows, num_samples=2, max_new_tokens=6, do_sample=False, return_log_probs=True)
    hf = HFGenerateEngine(engine.model, engine.processor).generate(rows, num_samples=2, max_new_tokens=6,
                                                                   do_sample=False, return_log_probs=True)
    width = min(ours.completion_ids.shape[1], hf.completion_ids.shape[1])
    assert torch.equal(ours.completion_ids[:, :width], hf.completion_ids[:, :width])
    assert torch.equal(ours.completion_mask[:, :width], hf.completion_mask[:, :width])
    torch.testing.assert_close(ours.extras["engine_log_probs"][:, :width], hf.extras["engine_log_probs"][:, :width],
                               atol=1e-3, rtol=0)


def test_vision_tokens_are_never_sampled(engine):
    """A near-uniform policy (the final norm scaled down: every logit ~0) would draw one of the 4 vision
    tokens in ~1% of the draws; the engine never does, while vLLM without the mask does (the control)."""
    from vllm import SamplingParams

    model = engine.model
    norm = model.model.language_model.norm
    forbidden = set(vision_token_ids(engine.processor))
    original = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight.mul_(1e-3)
        torch.manual_seed(5)
        rollout = engine.generate(_rows(), num_samples=8, max_new_tokens=48)
        drawn = rollout.completion_ids[rollout.completion_mask.bool()]
        assert drawn.numel() > 500
        assert not any(int(t) in forbidden for t in drawn)
        assert not rollout.extras["vision_cut"].any()
        # the control: the same engine, no allowed_token_ids: vision tokens are drawn
        prompts = engine._vllm_prompts(_rows())
        params = SamplingParams(n=8, max_tokens=48, temperature=1.0, seed=5, ignore_eos=True, detokenize=False)
        unmasked = [t for out in engine.llm.generate(prompts, params, use_tqdm=False)
                    for c in out.outputs for t in c.token_ids]
        assert any(int(t) in forbidden for t in unmasked)
    finally:
        with torch.no_grad():
            norm.weight.copy_(original)


def test_refuses_hf_logits_processors(engine):
    with pytest.raises(ValueError, match="rollout_engine: hf"):
        engine.generate(_rows(), num_samples=2, max_new_tokens=2, logits_processors=[lambda ids, scores: scores])


def test_fit_two_steps_with_the_vllm_config(tiny_path, tmp_path):
    """`mmpo fit -c configs/vlm/grpo_tiny_vllm.yaml`: 2 GRPO steps sampled by vLLM, with the IS correction
    reading the engine's log-probs (each trainer / engine ratio is 1 - the vision tokens' mass, ~1% here),
    step 2 after step 1 changed the weights."""
    assert main(tiny_grpo_fit_args(CONFIG, tiny_path, tmp_path,
        "--model.init_args.rollout_correction.mode=token_truncate",
        # the random model's rewards are all 0: an entropy bonus makes step 1 move the weights, so step 2
        # samples after a real (fused AdamW) update and its sync
        "--model.init_args.loss.entropy_coef=0.01", "--model.init_args.optim.lr=1e-3")) == 0
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("losses/policy")]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row["losses/policy"]))
        # after step 1's sync the engine and the trainer agree up to the vision mass: weights far below 1
        # (or above it) would mean a stale engine
        assert 0.9 < float(row["rollout_is/mean"]) <= 1.0 + 1e-3
        assert 0.0 <= float(row["rollout_is/kl"]) < 0.03
        # measured ~0.010 (the vision mass); without the sync after step 1's fused AdamW step, step 2's weight
        # mean was 1.017 (the engine sampled from the old weights)
        assert float(row["rollout_is/logp_diff_mean"]) < 0.02
    assert (tmp_path / "hf" / "config.json").is_file()
