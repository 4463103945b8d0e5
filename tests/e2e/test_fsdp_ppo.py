"""PPO with a separate value model under FSDP2 on 2 CPU processes (gloo) gives the one-process run; a sharded
checkpoint resumes it.

The run is tests/fixed_ppo_worker.py: a fixed global rollout (2 prompts x G 3, unequal lengths, fixed rewards);
one process trains on all of it, under FSDP2 each rank trains on one prompt's group with micro-batches of one
completion, the policy, its KL-in-reward reference and the critic sharded. 2 steps: step 1 is the critic's
warm-up (the policy must not move), step 2 trains both (value clipping active, gradients clipped per model, SGD
with momentum, whose state the sharded checkpoint carries). Launches: one process (1 and 2 steps), FSDP2 with
a checkpoint per step, FSDP2 resumed from the step-1 checkpoint; then the same resume with PPO's own AdamW.

The step-1 checkpoint is written during the warm-up, when only the critic has optimizer state: the resume must
not ask the checkpoint for the policy's (Lightning's sharded load did, and failed), and the policy must start
its first step without state, as in the uninterrupted run (AdamW's step count and bias correction included).
"""

from __future__ import annotations

import pytest
import torch
from distributed_support import build_data_parallel_tiny, run_fixed_ppo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_data_parallel_tiny(tmp_path_factory.mktemp("tiny"))


def _losses(log: str) -> tuple[float, float]:
    words = log.split()
    return float(words[words.index("policy_loss") + 1]), float(words[words.index("value_loss") + 1])


def test_fsdp2_critic_two_processes_match_one_process_and_resume(tiny_path, tmp_path):
    from mmpo.training.fsdp import MANIFEST
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    single1, log1 = run_fixed_ppo(tmp_path, "single", tiny_path, "single1", steps=1)
    assert "warmup 1.0" in log1
    # the warm-up step trains the critic alone: the policy is exactly the initial one
    assert all(torch.equal(single1[f"policy.{k}"], v) for k, v in initial.items())
    assert sum(not torch.equal(single1[f"critic.backbone.{k}"], v) for k, v in initial.items()) > 10

    single, log = run_fixed_ppo(tmp_path, "single", tiny_path, "single")
    ckpt = tmp_path / "ckpt"
    sharded, sharded_log = run_fixed_ppo(tmp_path, "fsdp", tiny_path, "fsdp", ckpt_dir=ckpt)
    assert "global_step 2" in sharded_log and "warmup 0.0" in sharded_log
    # the losses: the sum of the ranks' shares is the one-process loss
    for got, expected in zip(_losses(sharded_log), _losses(log)):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)
    # step 2's rollout-time values (the sharded critic after its step-1 update) and GAE returns, whose
    # last-token KL-in-reward term is 0 only if the policy did not move in the warm-up on both ranks
    torch.testing.assert_close(sharded["values"], single["values"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sharded["returns"], single["returns"], atol=1e-5, rtol=1e-4)
    assert float(single["values"].abs().max()) > 1.0  # not a trivial critic
    assert set(sharded) == set(single)
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert sum(not torch.equal(single[f"policy.{k}"], v) for k, v in initial.items()) > 10  # step 2 moved both
    assert sum(not torch.equal(single[f"critic.backbone.{k}"], single1[f"critic.backbone.{k}"])
               for k in initial) > 10
    assert not torch.equal(single["critic.head.weight"], single1["critic.head.weight"])

    step1 = ckpt / "epoch=0-step=1.ckpt"
    assert step1.is_dir() and (step1 / MANIFEST).is_file() and len(list(step1.glob("*.distcp"))) == 2
    resumed, resumed_log = run_fixed_ppo(tmp_path, "fsdp", tiny_path, "resumed", resume=step1)
    assert "global_step 2" in resumed_log
    assert _losses(resumed_log) == _losses(sharded_log)
    for name, value in sharded.items():
        # same processes, same shards, same order of operations: the resumed run is the same run
        torch.testing.assert_close(resumed[name], value, atol=1e-7, rtol=0, msg=name)


def test_fsdp2_critic_resumes_adamw_from_a_warmup_checkpoint(tiny_path, tmp_path):
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    ckpt = tmp_path / "ckpt"
    straight, log = run_fixed_ppo(tmp_path, "fsdp", tiny_path, "straight", ckpt_dir=ckpt, optimizer="adamw")
    resumed, resumed_log = run_fixed_ppo(tmp_path, "fsdp", tiny_path, "resumed", resume=ckpt / "epoch=0-step=1.ckpt",
                                         optimizer="adamw")
    assert "global_step 2" in resumed_log and _losses(resumed_log) == _losses(log)
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-7, rtol=0, msg=name)
    # AdamW's first policy step moves almost every weight by about lr (1e-3): a policy resumed with a state
    # made up for it (a step count of 1, as a zero-learning-rate initialising step leaves) would move less
    moved = [float((straight[f"policy.{k}"] - v).abs().max()) for k, v in initial.items()]
    assert sum(m > 5e-4 for m in moved) > 10
