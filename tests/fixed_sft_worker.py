"""One SFT step as one rank of DDP or FSDP2 (2 CPU processes, gloo): rank 0 trains on an image row,
rank 1 on a text-only row; SGD(lr=1), so the weight change is minus the (rank-averaged) gradient.

Run as a script (through tests/distributed_support.py) by tests/e2e/test_fsdp_vlm.py; not a test module:

    python fixed_sft_worker.py MODE MODEL_PATH OUT [KIND]  (MODE ddp or fsdp; KIND vlm (default) or text:
                                                           two text-task rows for a text-only LM)
"""

import os
import sys

import lightning as L
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from mmpo.algos.sft import SFTModule
from mmpo.data.synthetic import make_items
from mmpo.training.fsdp import FSDP2Strategy
from mmpo.vlm.fsdp import full_state_dict, is_sharded

torch.set_num_threads(1)
mode, model_path, out = sys.argv[1:4]
kind = sys.argv[4] if len(sys.argv) > 4 else "vlm"
if kind == "text":  # rows of two lengths, one per rank
    rows = make_items("long_arithmetic", 1, seed=0) + make_items("word_problem", 1, seed=0)
else:
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)


class PlainSGD(SFTModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1.0)


module = PlainSGD(model_path)
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                    strategy=FSDP2Strategy() if mode == "fsdp" else "ddp_find_unused_parameters_true",
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
trainer.fit(module, DataLoader([[rows[int(os.environ.get("LOCAL_RANK", "0"))]]], batch_size=None, collate_fn=lambda x: x))
assert is_sharded(module.model) == (mode == "fsdp")
state = full_state_dict(module.model)
if trainer.is_global_zero:
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print("global_step", trainer.global_step)
