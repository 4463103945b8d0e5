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

DPO and INPO (tests/fixed_preference_worker.py): rank 0 trains on an image prompt whose pair shares
it, rank 1 on a text-only one, the case that hung before the ranks agreed on the shared-prompt
forward (mmpo.vlm.shared_prompts: two backbone passes, so two all-gathers per decoder layer, on the
image rank, one on the other). Every FSDP2 launch runs under a collective timeout, so a hang fails
the test with an error instead of hanging it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from distributed_support import build_data_parallel_tiny, run_fixed_grpo, run_fixed_preference, run_fixed_sft

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
    # the rollout decoded by the lean loop on the gathered weights, as in the one-process run (mmpo.vlm.rollout)
    assert "decoders lean" in log
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
    assert saved["global_step"] == 1 and saved["hyper_parameters"]["sampling"]["num_generations"] == 3
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


def _assert_same(got, expected, *, atol, rtol=0.0):
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=rtol, msg=name)


def _moved(run, initial, prefix=""):
    return sum(not torch.equal(run[prefix + k], v) for k, v in initial.items())


def _single_sharded_resumed(tmp_path, algo, tiny_path):
    """1 process, FSDP2 (a sharded checkpoint per step), FSDP2 resumed from step 1: their weights and the
    step-1 checkpoint; each run checked to have reached step 2, its sharded weights equal to 1 process's."""
    single, _ = run_fixed_preference(tmp_path, algo, "single", tiny_path, "single")
    sharded, log = run_fixed_preference(tmp_path, algo, "fsdp", tiny_path, "fsdp", ckpt_dir=tmp_path / "ckpt")
    assert "global_step 2" in log
    _assert_same(sharded, single, atol=1e-5, rtol=1e-4)
    step1 = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    resumed, log = run_fixed_preference(tmp_path, algo, "fsdp", tiny_path, "resumed", resume=step1)
    assert "global_step 2" in log
    return single, sharded, resumed, step1


def test_fsdp2_dpo_two_processes_match_one_process_and_resume(tiny_path, tmp_path):
    """DPO (reference log-probs precomputed once on every rank, SGD with momentum), 2 steps: FSDP2 on 2
    processes gives the weights of 1 process; resuming from the sharded step-1 checkpoint (which carries the
    initial policy's reference log-probs) gives the uninterrupted run's weights."""
    from mmpo.training.fsdp import MANIFEST
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    single, sharded, resumed, step1 = _single_sharded_resumed(tmp_path, "dpo", tiny_path)
    assert _moved(single, initial) > 10
    assert any(not torch.equal(single[k], initial[k]) for k in single if "visual" in k)  # rank 0's image pair
    assert (step1 / MANIFEST).is_file() and len(list(step1.glob("*.distcp"))) == 2
    # recomputing the reference with the step-1 weights would change step 2: it is read from the checkpoint
    _assert_same(resumed, sharded, atol=1e-7)


def test_fsdp2_ranks_choosing_the_shared_prompt_forward_alone_are_stopped_by_the_timeout(tiny_path, tmp_path):
    """The deadlock this suite guards against, reproduced: with each rank deciding the shared-prompt forward
    by itself (the image rank runs the backbone twice, the text-only rank once), the ranks' collectives no
    longer match; the 15 s collective timeout ends the run with an error instead of a hang."""
    _, log = run_fixed_preference(tmp_path, "dpo", "fsdp", tiny_path, "local", timeout_s=15, agree="local",
                                  expect_ok=False)
    assert "Timed out waiting 15000ms" in log


def test_fsdp2_inpo_two_processes_match_one_process_and_resume(tiny_path, tmp_path):
    """INPO with pi_ref and pi_t sharded (pi_t samples on gathered weights, refreshed after every step): FSDP2
    on 2 processes gives the policy, pi_t and pi_ref of 1 process; the sharded checkpoint carries pi_t
    (``extra_state/``), so resuming from step 1 gives the uninterrupted run."""
    from mmpo.training.fsdp import EXTRA_STATE_DIR
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    single, sharded, resumed, step1 = _single_sharded_resumed(tmp_path, "inpo", tiny_path)
    assert _moved(sharded, initial) > 10
    for name, value in initial.items():
        assert torch.equal(sharded[f"reference.{name}"], value), name  # pi_ref stays the initial policy
        assert torch.equal(sharded[f"anchor.{name}"], sharded[name]), name  # pi_t = the policy after step 2
    assert (step1 / EXTRA_STATE_DIR).is_dir() and len(list((step1 / EXTRA_STATE_DIR).glob("*.distcp"))) == 2
    _assert_same(resumed, sharded, atol=1e-7)


def test_fsdp2_inpo_a_rank_without_a_pair_joins_with_a_zero_gradient(tiny_path, tmp_path):
    """The oracle pairs only rank 0's prompt: rank 1 runs a stand-in pair with weight 0 (the same forwards
    and backward, no hang), so the update is half of rank 0's pair gradient: one process training on that
    pair with half the learning rate gives the same weights."""
    single, _ = run_fixed_preference(tmp_path, "inpo", "single", tiny_path, "single", pairs="first")
    sharded, log = run_fixed_preference(tmp_path, "inpo", "fsdp", tiny_path, "fsdp", pairs="first")
    assert "global_step 2" in log
    _assert_same(sharded, single, atol=1e-5, rtol=1e-4)
