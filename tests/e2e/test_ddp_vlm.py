"""DDP with 2 CPU processes (gloo) gives the same GRPO update as one process on the same global batch.

The run itself is tests/fixed_grpo_worker.py (shared with the FSDP2 test).

The global batch is a fixed rollout (2 prompts x G 3, completions of different lengths, so a
rank-local token mean would give a different update).
One process trains on all of it; under DDP each rank trains on one prompt's group, with
micro-batches of one completion. With SGD(lr=1) the weight change is minus the gradient,
so equal weights mean equal gradients: the token normaliser is global across micro-batches
and ranks, and DDP's gradient averaging is undone by the world-size factor.

Rank 1's prompt is text-only, so the vision tower gets no gradient there: DDP needs
``find_unused_parameters`` (strategy ``ddp_find_unused_parameters_true``) for such data mixes.
"""

from __future__ import annotations

import pytest
import torch
from distributed_support import build_data_parallel_tiny, run_fixed_grpo


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_data_parallel_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("agg", ["token-mean"])
def test_ddp_two_processes_match_one_process(tiny_path, tmp_path, agg):
    from mmpo.vlm.factory import load_vlm

    initial = {k: v.clone() for k, v in load_vlm(tiny_path)[0].state_dict().items()}
    single, _ = run_fixed_grpo(tmp_path, "single", tiny_path, "single", agg=agg)
    ddp, _ = run_fixed_grpo(tmp_path, "ddp", tiny_path, "ddp", agg=agg)
    moved = 0
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10  # the step changed the weights (the comparison is not vacuous)
