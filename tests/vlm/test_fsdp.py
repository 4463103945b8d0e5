"""FSDP2 pieces on one process (gloo, world size 1) and the sharded-checkpoint manifest.

The 2-process equivalence and resume (GRPO, SFT, DPO, INPO) are tests/e2e/test_fsdp_vlm.py; here: a
sharded model computes the same log-probs (and gradients) and samples the same tokens as the unsharded
one, its log-probs ask every rank before choosing the shared-prompt forward, its full state dict is the
original weights, and the checks that refuse damaged checkpoints or unsupported strategies.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from mmpo.data.synthetic import make_items
from mmpo.training.checkpoint import CorruptCheckpointError  # noqa: F401  (the error the strategy raises)
from mmpo.training.fsdp import MANIFEST, all_finite, check_sharding_support, manifest_problem, write_manifest
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.fsdp import as_root_forward, full_state_dict, full_weights, is_sharded, shard_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine


@pytest.fixture(scope="module")
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), vocab_size=400, hidden_size=64, intermediate_size=128)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_sharded_model_matches_unsharded(one_rank_mesh, tiny, checkpointing):
    model, processor = load_vlm(tiny)
    sharded = copy.deepcopy(model)
    if checkpointing:  # as the real-size configs: recomputed layers inside FSDP2 units
        sharded.gradient_checkpointing_enable()
        sharded.train()
    shard_vlm(sharded, one_rank_mesh)
    assert is_sharded(sharded) and not is_sharded(model)
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)  # image + text-only

    torch.manual_seed(0)
    plain = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=5)
    torch.manual_seed(0)
    gathered = HFGenerateEngine(sharded, processor).generate(rows, num_samples=2, max_new_tokens=5)
    assert torch.equal(plain.completion_ids, gathered.completion_ids)

    def loss_and_grads(policy):
        log_probs, _ = completion_log_probs(policy, plain.prompt_inputs, plain.completion_ids, plain.completion_mask)
        loss = -(log_probs * plain.completion_mask).sum()
        loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in policy.named_parameters() if p.grad is not None}
        return log_probs.detach(), grads

    expected, expected_grads = loss_and_grads(model)
    got, got_grads = loss_and_grads(sharded)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert set(got_grads) == set(expected_grads) and any("visual" in n for n in got_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)

    full = full_state_dict(sharded)
    for name, value in model.state_dict().items():
        assert torch.equal(full[name], value), name


def test_sharded_log_probs_let_every_rank_agree_on_the_shared_prompt_forward(one_rank_mesh, tiny, monkeypatch):
    """The shared-prompt forward runs the backbone twice, the plain one once: under FSDP2 each call asks
    every rank once (all_ranks_agree) with its own batch's answer, before any backbone pass."""
    import mmpo.vlm.logprobs as logprobs
    from mmpo.vlm import fsdp

    model, processor = load_vlm(tiny)
    shard_vlm(model, one_rank_mesh)
    asked = []
    monkeypatch.setattr(logprobs, "all_ranks_agree", lambda m, flag: asked.append(flag) or fsdp.all_ranks_agree(m, flag))
    for task, expected in (("count_shapes", True), ("arithmetic", False)):  # repeated image prompt; text only
        torch.manual_seed(0)
        rollout = HFGenerateEngine(model, processor).generate(make_items(task, 1, seed=0), num_samples=2,
                                                              max_new_tokens=5, do_sample=True)
        with torch.no_grad():
            completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
        assert asked == [expected], task
        asked.clear()
    unsharded = load_vlm(tiny)[0]  # not sharded: nothing to agree on
    with torch.no_grad():
        completion_log_probs(unsharded, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    assert asked == []
    assert fsdp.all_ranks_agree(unsharded, True) and not fsdp.all_ranks_agree(model, False)


def test_full_weights_keeps_units_gathered_and_nests(one_rank_mesh, tiny):
    from torch.distributed.tensor import DTensor

    model = shard_vlm(load_vlm(tiny)[0], one_rank_mesh)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor)
    with full_weights(model):
        assert not isinstance(model.lm_head.weight, DTensor)  # the gathered (plain) parameter
        with full_weights(model):  # nested: no second gather, and leaving it keeps the weights gathered
            pass
        assert not isinstance(model.lm_head.weight, DTensor)
    assert isinstance(model.lm_head.weight, DTensor)  # resharded on leaving the outer block


def test_unsharded_model_passes_through():
    layer = torch.nn.Linear(2, 2)
    with full_weights(layer):
        pass
    assert as_root_forward(layer, lambda a, b: a + b, 2, b=3) == 5  # 2 + 3, called directly
    assert full_state_dict(layer).keys() == {"weight", "bias"}


def test_manifest_detects_changed_missing_and_extra_files(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"shard a")
    (tmp_path / "meta.pt").write_bytes(b"meta")
    assert manifest_problem(tmp_path) == "missing"
    write_manifest(tmp_path)
    assert (tmp_path / MANIFEST).read_text().count("\n") == 2
    assert manifest_problem(tmp_path) is None
    (tmp_path / "a.distcp").write_bytes(b"shard b")
    assert manifest_problem(tmp_path) == f"a.distcp does not match {MANIFEST} (bytes changed after it was written)"
    write_manifest(tmp_path)
    (tmp_path / "extra").write_bytes(b"x")
    assert manifest_problem(tmp_path) == f"extra is not listed in {MANIFEST}"
    (tmp_path / "extra").unlink()
    (tmp_path / "meta.pt").unlink()
    assert manifest_problem(tmp_path) == f"meta.pt listed in {MANIFEST} is missing"


def test_all_finite_reads_nested_states():
    assert all_finite({"w": torch.ones(2)}, [{"exp_avg": torch.zeros(3), "step": torch.tensor(1)}])
    assert not all_finite({"w": torch.ones(2)}, [{"exp_avg": torch.tensor([0.0, float("nan")])}])
    assert not all_finite({"w": torch.tensor([float("inf")])})


def test_unsupported_strategies_are_refused_with_the_fix():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    with pytest.raises(ValueError, match="FSDP1.*mmpo.training.fsdp.FSDP2Strategy"):
        check_sharding_support(FSDPStrategy())
    with pytest.raises(ValueError, match="tensor parallelism.*FSDP2Strategy"):
        check_sharding_support(ModelParallelStrategy())
    check_sharding_support(DDPStrategy())  # no error
    check_sharding_support(None)


def test_sharded_value_model_matches_unsharded(one_rank_mesh, tiny, tmp_path):
    """PPO's value model (mmpo.algos.ppo.TokenValueModel): the sharded critic computes the same values and
    gradients as the unsharded one, and its full weights (backbone and head) gather back for the export."""
    from mmpo.algos.ppo import TokenValueModel
    from mmpo.vlm.fsdp import full_value

    plain = TokenValueModel.load(tiny, head_init_std=0.02, seed=1)
    sharded = copy.deepcopy(plain)
    sharded.shard(one_rank_mesh, frozen=False)
    assert is_sharded(sharded.backbone) and not is_sharded(plain.backbone)
    model, processor = load_vlm(tiny)
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)  # image + text-only
    torch.manual_seed(0)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=4)
    mask = rollout.completion_mask.float()

    values, values_sharded = plain(rollout), sharded(rollout)
    torch.testing.assert_close(values_sharded, values)
    ((values * mask).sum()).backward()
    ((values_sharded * mask).sum()).backward()
    torch.testing.assert_close(full_value(sharded.head.weight.grad), plain.head.weight.grad)
    torch.testing.assert_close(full_value(sharded.head.bias.grad), plain.head.bias.grad)
    grads = {name: p.grad for name, p in plain.named_parameters()}
    sharded_grads = {name: p.grad for name, p in sharded.named_parameters()}
    key = next(k for k in grads if k.endswith("layers.0.mlp.down_proj.weight"))
    torch.testing.assert_close(full_value(sharded_grads[key]), grads[key])

    backbone_state, head_state = sharded.full_state()
    torch.testing.assert_close(head_state["weight"], plain.head.weight.detach())
    out = sharded.save(tmp_path / "critic", processor, state=(backbone_state, head_state))
    loaded = TokenValueModel.load(out, head_init_std=0.0)
    torch.testing.assert_close(loaded.head.weight, plain.head.weight.detach())
    for (name, a), (_, b) in zip(loaded.backbone.named_parameters(), plain.backbone.named_parameters()):
        torch.testing.assert_close(a, b.detach(), msg=name)
