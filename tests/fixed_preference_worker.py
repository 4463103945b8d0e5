"""One DPO or INPO run on fixed data, in 1 process or as one rank of FSDP2 (2 CPU processes, gloo).

Run as a script (through tests/distributed_support.py) by tests/e2e/test_fsdp_vlm.py; not a test module:

    python fixed_preference_worker.py ALGO MODE MODEL_PATH OUT STEPS CKPT_DIR RESUME PAIRS TIMEOUT_S AGREE

ALGO is dpo or inpo; MODE single or fsdp; CKPT_DIR "-" = no checkpoints, else one per step; RESUME
"-" = fresh, else a checkpoint to resume from. Two prompts, an image one (count_shapes) and a
text-only one (arithmetic): one process trains on both each step, under FSDP2 rank r on prompt r
(the image rank's pair shares its prompt: mmpo.vlm.shared_prompts would run its backbone twice, the
text-only rank's once). DPO: the synthetic (chosen, rejected) pairs. INPO: every process builds the
same global rollout from the anchor pi_t (seeded; 2 prompts x 3 completions of 6 tokens, sampled on
pi_t's gathered weights under FSDP2), and the oracle pairs each prompt's first and last completion;
PAIRS "both" = every prompt gets its pair, "first" = only the first prompt does (the text-only rank
has none and runs a stand-in pair with weight 0; one process then steps with half the learning
rate, the same update). INPO's anchor is refreshed after every step
(iteration_steps 1), so step 2 samples from the trained policy. The optimizer is SGD with momentum
(a state the sharded checkpoint must carry). TIMEOUT_S is the collective timeout: a hang ends the
run with an error. AGREE "ranks" is mmpo's code; "local" lets each rank choose the shared-prompt
forward alone (the bug: ranks run different collectives). Rank 0 writes the final full weights to OUT (safetensors; INPO adds ``anchor.``-prefixed
pi_t and ``reference.``-prefixed pi_ref weights) and prints ``global_step`` and the last loss.
"""

import os
import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from mmpo.algos.dpo import DPOModule
from mmpo.algos.inpo import INPOModule
from mmpo.data.preference import synthetic_preference_row
from mmpo.data.synthetic import make_items
from mmpo.training.config import SamplingConfig
from mmpo.training.fsdp import FSDP2Strategy
from mmpo.vlm.fsdp import full_state_dict, is_sharded
from mmpo.vlm.rollout import HFGenerateEngine

torch.set_num_threads(1)
algo, mode, model_path, out, steps, ckpt_dir, resume, pair_mode, timeout_s, agree = sys.argv[1:11]
kind = sys.argv[11] if len(sys.argv) > 11 else "vlm"  # text: two text-task prompts for a text-only LM
if agree == "local":  # the bug this guards against: each rank decides the shared-prompt forward alone
    import mmpo.vlm.logprobs

    mmpo.vlm.logprobs.all_ranks_agree = lambda model, flag: flag
parallel = mode != "single"
tasks = ("long_arithmetic", "word_problem") if kind == "text" else ("count_shapes", "arithmetic")
rows = [synthetic_preference_row(r, 0) for task in tasks for r in make_items(task, 1, seed=0)]
rank = int(os.environ.get("LOCAL_RANK", "0"))
lr = 0.5 if algo == "dpo" else 0.05
if pair_mode == "first" and not parallel:
    # under FSDP2 the first rank's pair gradient is averaged with the other rank's zero: half of it
    lr /= 2


class Data(L.LightningDataModule):
    train_rows = rows  # DPO precomputes the reference log-probs of every training pair

    def train_dataloader(self):
        batch = [rows[rank]] if parallel else rows
        return DataLoader([batch] * int(steps), batch_size=None, collate_fn=lambda x: x)


class SGD:
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)


class FixedDPO(SGD, DPOModule):
    pass


class FixedEngine:
    """The anchor's engine, always sampling the same global rollout; a rank keeps its prompt's group."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, batch, **kwargs):
        torch.manual_seed(0)
        full = self.engine.generate(rows, num_samples=3, max_new_tokens=6, do_sample=True)
        return full.select(list(range(3 * rank, 3 * rank + 3))) if parallel else full


class FixedINPO(SGD, INPOModule):
    def preference_pairs(self, rollout):
        groups = [0] if pair_mode == "first" else [0, 1]
        if parallel:  # this rank's group is the global group `rank`, at positions 0..2
            return ([(0, 2)] if rank in groups else []), {}
        return [(3 * g, 3 * g + 2) for g in groups], {}


if algo == "dpo":
    module = FixedDPO(model_path, beta=0.5)
else:
    module = FixedINPO(model_path, eta=2.0, tau=0.25, iteration_steps=1,
                       sampling=SamplingConfig(num_generations=3, max_new_tokens=6))
    module.anchor_engine = FixedEngine(HFGenerateEngine(module.anchor_model, module.processor))
callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if ckpt_dir != "-" else []
strategy = FSDP2Strategy(timeout=timedelta(seconds=float(timeout_s))) if parallel else "auto"
trainer = L.Trainer(accelerator="cpu", devices=2 if parallel else 1, strategy=strategy,
                    max_steps=int(steps), logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                    limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False)
trainer.fit(module, datamodule=Data(), ckpt_path=None if resume == "-" else resume)
assert is_sharded(module.model) == parallel
state = full_state_dict(module.model)  # under FSDP2 every rank joins the gather
if algo == "inpo":
    for name, model in (("anchor", module.anchor_model), ("reference", module.reference_model)):
        assert is_sharded(model) == parallel
        state.update({f"{name}.{k}": v for k, v in full_state_dict(model).items()})
if trainer.is_global_zero:
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print("global_step", trainer.global_step, "loss", float(trainer.callback_metrics.get("loss", float("nan"))))
