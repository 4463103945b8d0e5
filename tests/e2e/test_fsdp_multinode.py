"""FSDP2 over several nodes, and sharded checkpoints resumed at another world size (docs/distributed.md).

The run is tests/fixed_grpo_worker.py's fixed GRPO rollout (2 prompts x G 3, completions of unequal length;
2 steps, beta 0.5 so step 2 has a KL term to the sharded reference, SGD with momentum so the optimizer has a
state, gradient clipping by the norm over every shard).

Which equality is right: a data-parallel rank trains on its prompt's group only, but every loss term is
divided by the global normaliser (tokens summed over micro-batches and ranks) and multiplied by the world
size, which FSDP2's gradient average undoes. So the update of 2 ranks on the two halves of the rollout is
the update of 1 process on the whole rollout, to float rounding (sums in another order): the 2-node run is
compared with the 1-process run, not only with a 2-process single-node run. Each rank logs its share of the
global loss, so the ranks' sum of ``losses/policy`` is the 1-process loss.

For the same reason a checkpoint written at one world size resumes at another: DCP reshards the weights
and the momentum buffers onto the new world, the data split follows the world, and step 2 is the same
update. The resumed run equals the uninterrupted one to float rounding (1e-5, as 2 processes vs 1).

Two nodes are simulated on this machine: two ``torchrun --nnodes 2 --node_rank 0|1 --master_addr
127.0.0.1 --nproc_per_node 1`` launches, gloo; Lightning reads the world from torchelastic's
environment and checks it against ``trainer.devices`` (1) x ``trainer.num_nodes`` (2).
"""

from __future__ import annotations

import pytest
import torch
from distributed_support import build_data_parallel_tiny, run_fixed_grpo, run_fixed_grpo_nodes

pytestmark = pytest.mark.slow

SETTINGS = {"steps": 2, "beta": 0.5, "momentum": 0.9, "max_grad_norm": 0.05}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_data_parallel_tiny(tmp_path_factory.mktemp("tiny"))


def _value(log: str, key: str) -> float:
    return float(log.split(f" {key} ")[1].split()[0])


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)


def _moved(run: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> int:
    return sum(not torch.equal(run[k], v) for k, v in initial.items())


def test_two_nodes_match_one_process(tiny_path, tmp_path):
    """2 nodes x 1 process (torchrun on the loopback address, FSDP2, num_nodes 2): the loss and the final
    weights of 1 process."""
    from mmpo.vlm.factory import load_vlm

    initial = load_vlm(tiny_path)[0].state_dict()
    single, single_log = run_fixed_grpo(tmp_path, "single", tiny_path, "single", **SETTINGS)
    nodes, log = run_fixed_grpo_nodes(tmp_path, tiny_path, "nodes", **SETTINGS)
    assert "global_step 2" in log and "MEMBER: 1/2" in log  # global rank 0 of a world of 2
    assert _value(log, "kl") > 0  # step 2 saw a KL to the sharded reference
    # rank 0 logs only its share of the loss; the shares of both nodes add up to the one-process loss
    assert _value(log, "losses/policy") != pytest.approx(_value(single_log, "losses/policy"), abs=1e-3)
    assert _value(log, "rank_sum_policy_loss") == pytest.approx(_value(single_log, "losses/policy"), abs=1e-6)
    assert _value(log, "grad_norm") == pytest.approx(_value(single_log, "grad_norm"), rel=1e-5)
    _assert_same(nodes, single)
    assert _moved(single, initial) > 10  # the steps moved the weights: the comparison is not vacuous


def test_checkpoint_of_two_processes_resumes_on_one(tiny_path, tmp_path):
    """A sharded step-1 checkpoint of 2 FSDP2 processes, resumed by 1 FSDP2 process: step 2 there gives the
    weights of the uninterrupted 2-process run."""
    from mmpo.training.fsdp import MANIFEST

    ckpt = tmp_path / "ckpt"
    two, _ = run_fixed_grpo(tmp_path, "fsdp", tiny_path, "two", ckpt_dir=ckpt, **SETTINGS)
    step1 = ckpt / "epoch=0-step=1.ckpt"
    assert (step1 / MANIFEST).is_file() and len(list(step1.glob("*.distcp"))) == 2
    one, log = run_fixed_grpo(tmp_path, "fsdp1", tiny_path, "resumed_on_one", resume=step1, **SETTINGS)
    assert "global_step 2" in log
    _assert_same(one, two)


def test_checkpoint_of_one_process_resumes_on_two_nodes(tiny_path, tmp_path):
    """A sharded step-1 checkpoint of 1 FSDP2 process, resumed by 2 nodes x 1 process: the weights of the
    uninterrupted 1-process run."""
    ckpt = tmp_path / "ckpt"
    one, _ = run_fixed_grpo(tmp_path, "fsdp1", tiny_path, "one", ckpt_dir=ckpt, **SETTINGS)
    step1 = ckpt / "epoch=0-step=1.ckpt"
    assert len(list(step1.glob("*.distcp"))) == 1
    nodes, log = run_fixed_grpo_nodes(tmp_path, tiny_path, "resumed_on_two", resume=step1, **SETTINGS)
    assert "global_step 2" in log
    _assert_same(nodes, one)
