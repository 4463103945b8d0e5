"""One GRPO run on a fixed global rollout, in 1 process or as one rank of DDP / FSDP2 (2 CPU processes, gloo).

Run as a script (through tests/distributed_support.py) by tests/e2e/test_ddp_vlm.py and
tests/e2e/test_fsdp_vlm.py; not a test module:

    python fixed_grpo_worker.py MODE MODEL_PATH OUT AGG STEPS BETA MOMENTUM CKPT_DIR RESUME MAX_GRAD_NORM LORA

MODE is single, ddp or fsdp (2 processes started by Lightning), fsdp1 (FSDP2 on 1 process, the whole rollout:
the world size a 2-process checkpoint is resumed at, and that writes one a 2-process run resumes) or torchrun
(FSDP2, launched by ``torchrun``: ``devices`` = its LOCAL_WORLD_SIZE, ``num_nodes`` = WORLD_SIZE /
LOCAL_WORLD_SIZE, e.g. 2 nodes x 1 process on the loopback address, tests/e2e/test_fsdp_multinode.py);
CKPT_DIR "-" = no checkpoints, else one per step; RESUME "-" = fresh, else a checkpoint to resume from; MAX_GRAD_NORM 0 = no clipping; LORA 0 = full fine-tuning, else
configs/vlm/grpo_tiny_lora.yaml's adapter (rank 16, alpha 32, every text projection, frozen vision tower);
then the run also exports to OUT without its suffix + "_hf" (merged weights and the adapter) and OUT holds
``reference_log_probs`` (the adapter-disabled policy, sharded under FSDP2), ``policy_log_probs`` and
``base_log_probs`` (the unsharded model loaded from MODEL_PATH) of the fixed global rollout. The global rollout is 2 prompts x G 3 (seeded, the same in every
process), completions cut to unequal lengths so that a rank-local token mean would differ; a
data-parallel rank keeps its prompt's group and trains with micro-batches of one completion.
The optimizer is SGD (lr 1 without momentum: the weight change is minus the gradient). A text-only LM at
MODEL_PATH (mmpo.vlm.factory.model_kind) gets text prompts (long_arithmetic, countdown) instead of
(count_shapes, arithmetic), and its LoRA run has no vision tower to freeze. Rank 0
writes the final full weights to OUT (safetensors) and prints ``global_step`` and the last ``kl``, and
``rank_sum_policy_loss``: the sum over ranks of their last ``losses/policy`` (each rank logs its share of the
global loss, its tokens' terms over the global normaliser, so the sum is the one-process loss).
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from mmpo.algos.grpo import GRPOModule
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, OptimConfig, SamplingConfig
from mmpo.training.fsdp import FSDP2Strategy
from mmpo.training.lora import unwrap
from mmpo.vlm.factory import load_vlm, model_kind
from mmpo.vlm.fsdp import full_state_dict, is_sharded
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine

torch.set_num_threads(1)
mode, model_path, out, agg, steps, beta, momentum, ckpt_dir, resume, max_grad_norm, lora = sys.argv[1:12]
# under torchrun the world is what the launcher says (Lightning reads it from torchelastic's environment)
WORLD = int(os.environ.get("WORLD_SIZE", "1")) if mode == "torchrun" else {"single": 1, "fsdp1": 1}.get(mode, 2)
LOCAL = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if mode == "torchrun" else WORLD
parallel = WORLD > 1
text_only = model_kind(json.loads((Path(model_path) / "config.json").read_text())) == "text"
rows = (make_items("long_arithmetic", 1, seed=0) + make_items("countdown", 1, seed=0) if text_only
        else make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0))
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
STRATEGIES = {"single": "auto", "ddp": "ddp_find_unused_parameters_true", "fsdp": FSDP2Strategy(),
              "fsdp1": FSDP2Strategy(), "torchrun": FSDP2Strategy()}


class FixedGRPO(GRPOModule):
    """Every process builds the same global rollout (seeded); a data-parallel rank keeps its prompt's group."""

    def build_rollout(self, batch):
        torch.manual_seed(0)
        engine = HFGenerateEngine(unwrap(self.model), self.processor)
        full = engine.generate(rows, num_samples=3, max_new_tokens=6)
        self.decoders = getattr(self, "decoders", set()) | {engine.last_decode}
        # unequal lengths (as if EOS came early), so local and global normalisers differ:
        # rank 0 holds 12 tokens, rank 1 holds 6
        lengths = torch.tensor([6, 2, 4, 1, 2, 3])
        keep = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
        full.completion_mask = full.completion_mask * keep
        full.completion_ids = full.completion_ids.masked_fill(~keep, 0)
        if not parallel:
            return full
        return full.select(list(range(3 * self.global_rank, 3 * self.global_rank + 3)))

    def compute_rewards(self, rollout):
        return (REWARDS if not parallel else REWARDS[3 * self.global_rank : 3 * self.global_rank + 3]).clone(), {}

    def configure_optimizers(self):
        lr = 1.0 if float(momentum) == 0 else 0.5
        return torch.optim.SGD(self.model.parameters(), lr=lr, momentum=float(momentum))


LORA = {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0, "freeze_vision_tower": True,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
LORA = {**LORA, "freeze_vision_tower": False} if text_only else LORA
LORA = {**LORA, "output_dir": out.removesuffix(".safetensors") + "_hf"} if int(lora) else {}
module = FixedGRPO(model_path, sampling=SamplingConfig(num_generations=3),
                   loss=LossConfig(beta=float(beta), agg=agg),
                   optim=OptimConfig(max_grad_norm=float(max_grad_norm), micro_batch_size=1 if parallel else None),
                   **LORA)
callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if ckpt_dir != "-" else []
trainer = L.Trainer(accelerator="cpu", devices=LOCAL, num_nodes=WORLD // LOCAL, strategy=STRATEGIES[mode],
                    max_steps=int(steps), logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
batch = [rows[0]] if parallel else rows  # prompts per rank: 1 in data parallel, both in one process
trainer.fit(module, DataLoader([batch] * 2, batch_size=None, collate_fn=lambda x: x),
            ckpt_path=None if resume == "-" else resume)
sharded_modes = ("fsdp", "fsdp1", "torchrun")
assert is_sharded(module.model) == (mode in sharded_modes)
assert trainer.world_size == WORLD and trainer.num_nodes == WORLD // LOCAL
if module.reference_model is not None:
    assert is_sharded(module.reference_model) == (mode in sharded_modes)
policy_loss = torch.tensor(float(module.last_metrics["losses/policy"]), dtype=torch.float64)
if parallel:
    torch.distributed.all_reduce(policy_loss)
state = full_state_dict(module.model)  # under FSDP2 every rank joins the gather
if LORA:  # the KL reference of a LoRA policy (its adapter disabled), sharded, against the base model
    torch.manual_seed(0)
    rollout = HFGenerateEngine(unwrap(module.model), module.processor).generate(rows, num_samples=3, max_new_tokens=6)
    with torch.no_grad():
        inputs = (rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
        with module.reference_policy() as reference:
            state["reference_log_probs"] = completion_log_probs(reference, *inputs)[0]
        state["policy_log_probs"] = completion_log_probs(module.model, *inputs)[0]
        state["base_log_probs"] = completion_log_probs(load_vlm(model_path)[0], *inputs)[0]
rank_losses = [module.last_metrics["losses/policy"]]
if parallel:  # every rank's last policy loss (each a share of the global token mean), for the 2-vs-1 check
    import torch.distributed as dist

    rank_losses = [None] * trainer.world_size
    dist.all_gather_object(rank_losses, module.last_metrics["losses/policy"])
if trainer.is_global_zero:
    print("rank_policy_losses", ",".join(repr(float(v)) for v in rank_losses))
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print("global_step", trainer.global_step, "kl", module.last_metrics.get("kl", 0.0), "losses/policy",
          module.last_metrics["losses/policy"], "rank_sum_policy_loss", f"{float(policy_loss):.9e}", "grad_norm", module.last_metrics["policy/grad_norm"],
          "decoders", ",".join(sorted(getattr(module, "decoders", set()))) or "-")
