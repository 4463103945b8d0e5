"""FSDP2 with 2 CPU processes (gloo) gives the same GRPO run as one process; a sharded checkpoint resumes it.

The run is tests/fixed_grpo_worker.py, as in the DDP test (tests/e2e/test_ddp_vlm.py): a fixed
global rollout (2 prompts x G 3, completions of different lengths); one process trains on all of
it, under FSDP2 each rank trains on one prompt's group with micro-batches of one completion.
Here the run is 2 steps with beta > 0, so the second step's KL term uses the sharded reference
model, with gradient clipping (by the norm over every shard) and SGD with momentum, so the optimizer
has a state that the sharded checkpoint must carry.
Rank 1's prompt is text-only: that rank never runs the vision tower, which FSDP2 must still
reduce-scatter (zeros) without hanging. Generation runs on gathered full weights every step.

Four launches (~40 s of CPU): one process (2 steps); FSDP2 (2 steps, a sharded checkpoint after each
step); FSDP2 resumed from the step-1 checkpoint; FSDP2 refused a damaged copy of it. SFT: one step on
2 processes under FSDP2 equals the same step under DDP (tests/fixed_sft_worker.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from distributed_support import build_data_parallel_tiny, run_fixed_grpo, run_fixed_sft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_data_parallel_tiny(tmp_path_factory.mktemp("tiny"))


def test_fsdp2_two_processes_match_one_process_and_resume(tiny_path, tmp_path):
    from mmpo.training.fsdp import MANIFEST
    from mmpo.training.resume_args import read_checkpoint
    from mmpo.vlm.factory import load_vlm

    initial = {k: v.clone() for k, v in load_vlm(tiny_path)[0].state_dict().items()}
    settings = {"steps": 2, "beta": 0.5, "momentum": 0.9, "max_grad_norm": 0.05}
    single, _ = run_fixed_grpo(tmp_path, "single", tiny_path, "single", **settings)
    ckpt = tmp_path / "ckpt"
    sharded, log = run_fixed_grpo(tmp_path, "fsdp", tiny_path, "fsdp", ckpt_dir=ckpt, **settings)
    assert "global_step 2" in log
    assert float(log.split(" kl ")[1].split()[0]) > 0  # step 2 saw a KL to the sharded reference
    # the gradient norm (over both ranks' shards) exceeded max_grad_norm: the equality below covers clipping
    assert float(log.split(" grad_norm ")[1].split()[0]) > 0.05

    moved = 0
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10  # the steps changed the weights (the comparison is not vacuous)
    # the vision tower moved too: rank 0's image group trained it while rank 1 contributed zeros
    assert any(not torch.equal(single[k], initial[k]) for k in single if "visual" in k)

    # the step-1 checkpoint is a verified directory: one shard file per rank, metadata, a manifest
    step1 = ckpt / "epoch=0-step=1.ckpt"
    assert step1.is_dir() and (step1 / MANIFEST).is_file()
    assert len(list(step1.glob("*.distcp"))) == 2
    # what --ckpt_path compares with the config (mmpo.training.resume_args): hyper-parameters and shapes
    saved = read_checkpoint(step1)
    assert saved["global_step"] == 1 and saved["hyper_parameters"]["num_generations"] == 3
    assert saved["state_dict"] == {f"model.{k}": v.shape for k, v in initial.items()}
    resumed, log = run_fixed_grpo(tmp_path, "fsdp", tiny_path, "resumed", resume=step1, **settings)
    assert "global_step 2" in log
    for name, value in sharded.items():
        # same processes, same shards, same order of operations: the resumed run is the same run
        torch.testing.assert_close(resumed[name], value, atol=1e-7, rtol=0, msg=name)

    # one flipped byte in a shard: the resume is refused, naming the file
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(step1, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _, log = run_fixed_grpo(tmp_path, "fsdp", tiny_path, "refused", resume=damaged, expect_ok=False, **settings)
    assert "CorruptCheckpointError" in log and f"{shard.name} does not match {MANIFEST}" in log


def test_fsdp2_sft_step_matches_ddp(tiny_path, tmp_path):
    """SFT (automatic optimisation, per-rank token mean) on 2 processes: FSDP2 averages the gradients
    over ranks exactly as DDP does, with a text-only row on rank 1."""
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    ddp = run_fixed_sft(tmp_path, "ddp", tiny_path)
    sharded = run_fixed_sft(tmp_path, "fsdp", tiny_path)
    for name, value in ddp.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert sum(not torch.equal(v, initial[k]) for k, v in ddp.items()) > 10  # the step moved the weights


def test_fsdp2_lora_two_processes_match_one_process(tiny_path, tmp_path):
    """GRPO with configs/vlm/grpo_tiny_lora.yaml's adapter (rank 16, every text projection, frozen vision
    tower) on 2 FSDP2 processes: the same adapter weights as 1 process, only adapter tensors changed, the
    KL reference (the adapter-disabled policy, sharded) computes the base model's log-probs, and the
    export (gathered from the shards) is the merged weights and the adapter of the 1-process run."""
    from safetensors.torch import load_file

    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    settings = {"steps": 2, "beta": 0.5, "momentum": 0.9, "max_grad_norm": 0.05, "lora": True}
    single, _ = run_fixed_grpo(tmp_path, "single", tiny_path, "single", **settings)
    sharded, log = run_fixed_grpo(tmp_path, "fsdp", tiny_path, "fsdp", **settings)
    assert "global_step 2" in log
    assert float(log.split(" kl ")[1].split()[0]) > 0  # step 2's KL to the adapter-disabled reference

    outputs = {"reference_log_probs", "policy_log_probs", "base_log_probs"}
    adapters = [k for k in single if "lora_" in k]
    assert len(adapters) == 2 * 7 * 2  # lora_A and lora_B on 7 projections of each of the 2 decoder layers
    assert set(sharded) == set(single)
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
        if name in outputs or "lora_" in name:
            continue
        # every base weight (the vision tower's included) is exactly the starting one
        assert torch.equal(value, initial[name.replace(".base_layer.", ".")]), name
        assert torch.equal(sharded[name], initial[name.replace(".base_layer.", ".")]), name
    # lora_B starts at zero (peft): every one of them was trained
    assert all(sharded[k].abs().sum() > 0 for k in adapters if "lora_B" in k)

    # the reference: the adapter switched off computes the base model (to float rounding), the policy does not
    for run in (single, sharded):
        torch.testing.assert_close(run["reference_log_probs"], run["base_log_probs"], atol=1e-6, rtol=0)
        assert (run["policy_log_probs"] - run["base_log_probs"]).abs().max() > 1e-4

    # the export of the sharded run: merged weights (base + scaling B A) and the adapter, as the single run's
    merged = {}
    for run in ("single", "fsdp"):
        merged[run] = load_vlm(tmp_path / f"{run}_hf")[0].state_dict()  # read without peft
        adapter = load_file(tmp_path / f"{run}_hf" / "adapter" / "adapter_model.safetensors")
        assert len(adapter) == len(adapters)
    assert set(merged["fsdp"]) == set(initial)
    for name, value in merged["single"].items():
        torch.testing.assert_close(merged["fsdp"][name], value, atol=1e-5, rtol=1e-4, msg=name)
    q = "model.language_model.layers.0.self_attn.q_proj"
    delta = sharded[f"{q}.lora_B.default.weight"] @ sharded[f"{q}.lora_A.default.weight"] * (32 / 16)
    torch.testing.assert_close(merged["fsdp"][f"{q}.weight"], initial[f"{q}.weight"] + delta, atol=1e-6, rtol=0)
    assert not torch.equal(merged["fsdp"][f"{q}.weight"], initial[f"{q}.weight"])
