"""DDP with 2 CPU processes (gloo) gives the same GRPO update as one process on the same global batch.

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

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

WORKER = textwrap.dedent(
    '''
    import sys
    import lightning as L
    import torch
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from mmpo.algos.grpo import GRPOModule
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.rollout import HFGenerateEngine

    torch.set_num_threads(1)
    mode, model_path, out, agg = sys.argv[1:5]
    ddp = mode == "ddp"
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)
    REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])


    class FixedGRPO(GRPOModule):
        """Every process builds the same global rollout (seeded); a DDP rank keeps its prompt's group."""

        def build_rollout(self, batch):
            torch.manual_seed(0)
            full = HFGenerateEngine(self.model, self.processor).generate(rows, num_samples=3, max_new_tokens=6)
            # unequal lengths (as if EOS came early), so local and global normalisers differ:
            # rank 0 holds 12 tokens, rank 1 holds 6
            lengths = torch.tensor([6, 2, 4, 1, 2, 3])
            keep = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
            full.completion_mask = full.completion_mask * keep
            full.completion_ids = full.completion_ids.masked_fill(~keep, 0)
            if not ddp:
                return full
            return full.select(list(range(3 * self.global_rank, 3 * self.global_rank + 3)))

        def compute_rewards(self, rollout):
            return (REWARDS if not ddp else REWARDS[3 * self.global_rank : 3 * self.global_rank + 3]).clone(), {}

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=1.0)


    module = FixedGRPO(model_path, num_generations=3, beta=0.0, max_grad_norm=0.0, agg=agg,
                       micro_batch_size=1 if ddp else None)
    trainer = L.Trainer(accelerator="cpu", devices=2 if ddp else 1, strategy="ddp_find_unused_parameters_true" if ddp else "auto",
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    batch = [rows[0]] if ddp else rows  # prompts per rank: 1 under DDP, both in one process
    trainer.fit(module, DataLoader([batch] * 2, batch_size=None, collate_fn=lambda x: x))
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in module.model.state_dict().items()}, out)
        print("lossess/policy", module.last_metrics["losses/policy"])
    '''
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def _run(tmp_path, mode, tiny_path, agg):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{mode}.safetensors"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(script), mode, tiny_path, str(out), agg], env=env,
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return load_file(out)


@pytest.mark.parametrize("agg", ["token-mean"])
def test_ddp_two_processes_match_one_process(tiny_path, tmp_path, agg):
    from mmpo.vlm.factory import load_vlm

    initial = {k: v.clone() for k, v in load_vlm(tiny_path)[0].state_dict().items()}
    single = _run(tmp_path, "single", tiny_path, agg)
    ddp = _run(tmp_path, "ddp", tiny_path, agg)
    moved = 0
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10  # the step changed the weights (the comparison is not vacuous)
