"""The vLLM rollout engine (mmpo.vlm.vllm_engine) on a tiny Qwen3 text LM (issue 38: the text path).

These tests need vLLM: they run in the vLLM venv (scripts/install_vllm_cpu.sh, docs/vllm.md):

    .venv-vllm/bin/python -m pytest tests/llm/test_vllm_text_engine.py

In a venv without vLLM tests/llm/conftest.py leaves this file out of the collection and says so in pytest's
header (the HF engine's text tests always run: tests/llm/test_loading.py).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from tiny_vlm_support import TEXT_TEST_TASKS, build_small_text_lm, tiny_grpo_fit_args

import mmpo.vlm.vllm_engine as vllm_engine
from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import TextProcessor, load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.processing import encode_prompts, repeat_rows
from mmpo.vlm.rollout import HFGenerateEngine
from mmpo.vlm.vllm_engine import VLLMEngine

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llm" / "grpo_tiny_vllm.yaml"
# vLLM's float32 CPU forward against the trainer's (both fp32, different kernels): measured ~1e-6
LOG_PROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # hidden 128 / 4 heads: head_dim 32 (vLLM's CPU attention has no kernel for head_dim 16 or 8: "Unsupported
    # CPU attention configuration")
    return build_small_text_lm(tmp_path_factory.mktemp("tiny_text"), hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def engine(tiny_path):
    """One colocated vLLM engine for the module (building one takes ~20 s on this CPU)."""
    model, processor = load_vlm(tiny_path)
    assert isinstance(processor, TextProcessor) and type(model).__name__ == "Qwen3ForCausalLM"
    return VLLMEngine(model, processor, model_path=str(tiny_path), max_model_len=1024, max_num_batched_tokens=4096)


def _rows():
    return make_items("long_arithmetic", 2, seed=0) + make_items("countdown", 1, seed=0)


def _teacher_forced(model, rollout, temperature):
    """The trainer's log-probs of the sampled tokens: its chunked forward on [prompt | completion] with the
    logits divided by the sampling temperature (a text LM has no token mask; top_p = 1)."""
    with torch.no_grad():
        return completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask,
                                    temperature=temperature)[0]


def test_text_prompts_groups_and_seeds(engine):
    rows = _rows()
    assert engine.text_only and engine.forbidden_ids == []
    # ChatML's turn end, as the HF engine's; nothing banned, so vLLM gets no allowed-token list
    assert engine.eos_token_id == engine.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    rollout = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert engine._allowed is None
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["id"] for r in rollout.rows] == [r["id"] for r in rows for _ in range(3)]
    # the trainer's prompt batch repeated per sample: input ids and mask, no image keys
    expected = encode_prompts(engine.processor, rows)
    assert set(rollout.prompt_inputs.keys()) == {"input_ids", "attention_mask", "image_counts"}
    for key, value in repeat_rows(expected, 3).items():
        assert torch.equal(rollout.prompt_inputs[key], value), key
    # what vLLM was given: the tokenizer's own chat template over [system, user], token for token
    tokenizer = engine.processor.tokenizer
    for row, prompt in zip(rows, engine._vllm_prompts(rows)):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["problem"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        assert prompt == {"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
    assert len({tuple(x) for x in rollout.completion_ids[:3].tolist()}) > 1  # the G samples differ
    assert not rollout.extras["vision_cut"].any()
    # the same torch seed gives the same samples; another seed other ones
    torch.manual_seed(0)
    again = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert torch.equal(again.completion_ids, rollout.completion_ids)
    torch.manual_seed(1)
    other = engine.generate(rows, num_samples=3, max_new_tokens=6)
    assert not torch.equal(other.completion_ids, rollout.completion_ids)


def test_greedy_equals_the_hf_engine_token_for_token(engine):
    """Greedy decoding (validation, ``mmpo eval``): vLLM's tokens are the HF engine's, every one, with the
    same log-probs."""
    rows = _rows()
    hf_engine = HFGenerateEngine(engine.model, engine.processor)
    ours = engine.generate(rows, num_samples=2, max_new_tokens=12, do_sample=False, return_log_probs=True)
    hf = hf_engine.generate(rows, num_samples=2, max_new_tokens=12, do_sample=False, return_log_probs=True)
    assert hf_engine.last_decode == "greedy"  # the HF engine decodes greedily with HF generate
    lengths = hf.completion_mask.sum(-1)
    assert torch.equal(ours.completion_mask.sum(-1), lengths)
    assert int(lengths.min()) >= 3  # non-trivial completions (the random tiny model rarely ends its turn)
    width = int(lengths.max())
    assert torch.equal(ours.completion_ids[:, :width], hf.completion_ids[:, :width])
    assert torch.equal(ours.completion_mask[:, :width], hf.completion_mask[:, :width])
    assert ours.texts == hf.texts
    mask = hf.completion_mask[:, :width].bool()
    torch.testing.assert_close(ours.extras["engine_log_probs"][:, :width][mask],
                               hf.extras["engine_log_probs"][:, :width][mask], atol=LOG_PROB_TOLERANCE, rtol=0)


def test_sampling_log_probs_equal_the_trainers_before_and_after_a_weight_sync(engine):
    model = engine.model
    rows = _rows()
    temperature = 0.7
    torch.manual_seed(3)
    before = engine.generate(rows, num_samples=2, max_new_tokens=10, temperature=temperature, return_log_probs=True)
    mask = before.completion_mask.bool()
    assert int(mask.sum()) >= 30
    diff = (before.extras["engine_log_probs"] - _teacher_forced(model, before, temperature))[mask]
    assert diff.abs().max() < LOG_PROB_TOLERANCE
    # masked positions hold 0 (the rollout IS correction and the losses read them under the mask)
    assert torch.all(before.extras["engine_log_probs"][~mask] == 0)
    # an optimizer step on the policy (the trainer's in-place update): the next generate syncs the weights
    syncs = engine.num_syncs
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(4)
    for param in model.parameters():
        param.grad = 0.05 * torch.randn_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    after = engine.generate(rows, num_samples=2, max_new_tokens=10, temperature=temperature, return_log_probs=True)
    assert engine.num_syncs == syncs + 1
    mask = after.completion_mask.bool()
    diff = (after.extras["engine_log_probs"] - _teacher_forced(model, after, temperature))[mask]
    assert diff.abs().max() < LOG_PROB_TOLERANCE
    # the control: the step moved the log-probs far beyond the tolerance (the first rollout's tokens, the new
    # policy against the engine's old log-probs), so the agreement after it comes from the sync
    before_mask = before.completion_mask.bool()
    stale = (before.extras["engine_log_probs"] - _teacher_forced(model, before, temperature))[before_mask]
    assert stale.abs().max() > 1e-2
    # no optimizer step, no sync
    engine.generate(rows[:1], num_samples=2, max_new_tokens=2)
    assert engine.num_syncs == syncs + 1


def test_fit_two_steps_with_the_text_vllm_config(tiny_path, tmp_path, monkeypatch):
    """`mmpo fit -c configs/llm/grpo_tiny_vllm.yaml`: 2 GRPO steps on the text LM sampled by vLLM, with the IS
    correction reading the engine's log-probs. A text LM has no vision mass, so after each sync the engine and
    the trainer agree: every IS weight is 1 within the log-prob tolerance, also at step 2, after step 1 moved
    the weights (a stale engine would show: the control below). The random model's rewards are all 0, so an
    entropy bonus makes step 1 move the weights."""
    calls = []
    generate = vllm_engine.VLLMEngine.generate

    def counted(self, rows, **kwargs):
        calls.append(len(rows))
        return generate(self, rows, **kwargs)

    monkeypatch.setattr(vllm_engine.VLLMEngine, "generate", counted)
    assert main(tiny_grpo_fit_args(CONFIG, tiny_path, tmp_path, "--model.init_args.sampling.max_new_tokens=8",
                                   "--model.init_args.loss.entropy_coef=0.01", "--model.init_args.optim.lr=1e-3",
                                   "--model.init_args.rollout_correction.mode=token_truncate",
                                   tasks=tuple(TEXT_TEST_TASKS))) == 0
    assert calls == [2, 2]  # both steps' rollouts came from vLLM (2 prompts each)
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("losses/policy")]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row["losses/total"])) and float(row["losses/entropy"]) > 1.0
        assert abs(float(row["rollout_is/mean"]) - 1.0) < 1e-4
        assert float(row["rollout_is/logp_diff_mean"]) < 1e-5  # measured ~1e-7
        assert float(row["rollout_is/clipped_frac"]) == 0.0
    # the control: the first step's update moves the log-probs by far more than that, so step 2's agreement
    # means vLLM sampled from the synced weights
    start, processor = load_vlm(tiny_path)
    trained, _ = load_vlm(tmp_path / "hf")
    assert type(trained).__name__ == "Qwen3ForCausalLM"
    torch.manual_seed(0)
    rollout = HFGenerateEngine(trained, processor).generate(make_items("long_arithmetic", 2, seed=1), num_samples=2,
                                                            max_new_tokens=8)
    mask = rollout.completion_mask.bool()
    moved = (_teacher_forced(trained, rollout, 1.0) - _teacher_forced(start, rollout, 1.0))[mask].abs().mean()
    assert moved > 1e-3
