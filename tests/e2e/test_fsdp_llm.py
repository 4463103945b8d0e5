"""FSDP2 on a text-only LM (issue 38): the fixed GRPO run of tests/fixed_grpo_worker.py (text prompts for a
text model) on 2 CPU processes (gloo) equals 1 process, resumes from its sharded checkpoint to the same
weights, and with LoRA trains the same adapters with an adapter-disabled reference equal to the base model;
SFT (tests/fixed_sft_worker.py) and DPO (tests/fixed_preference_worker.py) on text rows: FSDP2 on 2 processes
equals DDP / 1 process, and DPO resumes from its sharded checkpoint."""

from __future__ import annotations

import pytest
import torch
from distributed_support import run_fixed_grpo, run_fixed_preference, run_fixed_sft
from tiny_vlm_support import build_small_text_lm

from mmpo.vlm.factory import load_vlm


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


def test_fsdp2_text_lm_two_processes_match_one_process_and_resume(text_path, tmp_path):
    initial = {k: v.clone() for k, v in load_vlm(text_path)[0].state_dict().items()}
    settings = {"steps": 2, "beta": 0.5, "momentum": 0.9, "max_grad_norm": 0.05}
    single, log = run_fixed_grpo(tmp_path, "single", text_path, "single", **settings)
    assert "decoders lean" in log
    (single_loss,) = map(float, log.split("rank_policy_losses ")[1].split()[0].split(","))
    ckpt = tmp_path / "ckpt"
    sharded, log = run_fixed_grpo(tmp_path, "fsdp", text_path, "fsdp", ckpt_dir=ckpt, **settings)
    assert "global_step 2" in log and "decoders lean" in log
    assert float(log.split(" kl ")[1].split()[0]) > 0  # step 2 saw a KL to the sharded reference
    # the policy loss is a global token mean: each rank logs its tokens' share (normalised by the global token
    # count), and the shares add up to the 1-process loss, although rank 0 holds 12 tokens and rank 1 holds 6
    rank_losses = list(map(float, log.split("rank_policy_losses ")[1].split()[0].split(",")))
    assert len(rank_losses) == 2 and rank_losses[0] != pytest.approx(rank_losses[1], abs=1e-3)
    assert sum(rank_losses) == pytest.approx(single_loss, abs=1e-5)
    moved = 0
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10

    resumed, log = run_fixed_grpo(tmp_path, "fsdp", text_path, "resumed", resume=ckpt / "epoch=0-step=1.ckpt",
                                  **settings)
    assert "global_step 2" in log
    for name, value in sharded.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-7, rtol=0, msg=name)


def test_fsdp2_text_lm_lora_two_processes_match_one_process(text_path, tmp_path):
    initial = load_vlm(text_path)[0].state_dict()
    settings = {"steps": 2, "beta": 0.5, "momentum": 0.9, "max_grad_norm": 0.05, "lora": True}
    single, _ = run_fixed_grpo(tmp_path, "single", text_path, "single", **settings)
    sharded, log = run_fixed_grpo(tmp_path, "fsdp", text_path, "fsdp", **settings)
    assert "global_step 2" in log
    outputs = {"reference_log_probs", "policy_log_probs", "base_log_probs"}
    adapters = [k for k in single if "lora_" in k]
    assert len(adapters) == 2 * 7 * 2  # lora_A and lora_B on 7 projections of each of the 2 decoder layers
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
        if name in outputs or "lora_" in name:
            continue
        assert torch.equal(sharded[name], initial[name.replace(".base_layer.", ".")]), name
    for run in (single, sharded):
        torch.testing.assert_close(run["reference_log_probs"], run["base_log_probs"], atol=1e-6, rtol=0)
        assert (run["policy_log_probs"] - run["base_log_probs"]).abs().max() > 1e-4
    merged = load_vlm(tmp_path / "fsdp_hf")[0]
    assert type(merged).__name__ == "Qwen3ForCausalLM"


def test_fsdp2_text_sft_step_matches_ddp(text_path, tmp_path):
    """One SFT step on a text LM, a row of a different length per rank: FSDP2 averages the gradients over the
    ranks exactly as DDP does."""
    initial = load_vlm(text_path)[0].state_dict()
    ddp = run_fixed_sft(tmp_path, "ddp", text_path, "text")
    sharded = run_fixed_sft(tmp_path, "fsdp", text_path, "text")
    for name, value in ddp.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert sum(not torch.equal(v, initial[k]) for k, v in ddp.items()) > 10  # the step moved the weights


def test_fsdp2_text_dpo_two_processes_match_one_process_and_resume(text_path, tmp_path):
    """DPO on text pairs, 2 steps (SGD with momentum): FSDP2 on 2 processes gives the weights of 1 process, and
    resuming from the sharded step-1 checkpoint gives the uninterrupted run's weights."""
    initial = load_vlm(text_path)[0].state_dict()
    single, _ = run_fixed_preference(tmp_path, "dpo", "single", text_path, "single", kind="text")
    sharded, log = run_fixed_preference(tmp_path, "dpo", "fsdp", text_path, "fsdp", ckpt_dir=tmp_path / "ckpt",
                                        kind="text")
    assert "global_step 2" in log
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert sum(not torch.equal(v, initial[k]) for k, v in single.items() if k in initial) > 10
    resumed, log = run_fixed_preference(tmp_path, "dpo", "fsdp", text_path, "resumed",
                                        resume=tmp_path / "ckpt" / "epoch=0-step=1.ckpt", kind="text")
    assert "global_step 2" in log
    for name, value in sharded.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-7, rtol=0, msg=name)
