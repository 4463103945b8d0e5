"""PPO's value model under FSDP2 on one process (gloo, world size 1): the sharded critic computes the same values
and the same gradients as the unsharded one, and its full weights (backbone and head) gather back for export."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from mmpo.algos.ppo import TokenValueModel
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.fsdp import full_value, is_sharded
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


def test_sharded_value_model_matches_unsharded(one_rank_mesh, tmp_path):
    tiny = build_tiny_vlm(tmp_path / "tiny", vocab_size=400, hidden_size=64, intermediate_size=128)
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
