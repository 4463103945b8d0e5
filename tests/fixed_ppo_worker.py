"""One PPO-with-a-critic run on a fixed global rollout, in 1 process or as one rank of FSDP2 (2 CPU processes, gloo).

Run as a script (through tests/distributed_support.py) by tests/e2e/test_fsdp_ppo.py; not a test module:

    python fixed_ppo_worker.py MODE MODEL_PATH OUT STEPS CKPT_DIR RESUME OPTIMIZER

MODE is single or fsdp (2 processes started by Lightning); CKPT_DIR "-" = no checkpoints, else one per step;
RESUME "-" = fresh, else a checkpoint to resume from. The global rollout is 2 prompts x G 3 (an image prompt
and a text-only one, seeded, the same in every process), completions cut to unequal lengths, fixed rewards; a
rank keeps its prompt's group and trains with micro-batches of one completion. The module is
:class:`mmpo.algos.ppo.PPOModule` with a separate value model (sharded as a policy under FSDP2), the KL in the
reward (the sharded reference), GAE with lam 0.95, value clipping, gradient clipping per model, and a critic
warm-up of one step (step 1 trains the critic alone, step 2 both). Advantages are not whitened: each rank
whitens its own rollout (docs/ppo.md), so whitening is the one thing that differs from one process by design.
OPTIMIZER sgd: SGD with momentum (a state the sharded checkpoint must carry), the policy and the critic as
two parameter groups with their own learning rates; adamw: PPO's own (AdamW, the critic its own group), whose
first step divides by the gradients' magnitudes, too sensitive to float rounding for a 2-vs-1 comparison, used
for resumes (the policy has no AdamW state in a checkpoint written during the warm-up).

Rank 0 writes to OUT (safetensors) the final full weights of the policy (``policy.*``) and of the critic
(``critic.*``: backbone and head), the last step's rollout-time values V(s_t) and returns of the whole global
rollout (``values``, ``returns``: the ranks' rows in order), and prints ``global_step`` and the sums over ranks
of the last step's ``losses/policy`` and ``losses/value`` (each rank logs its share of the global token mean,
so the sum is the one-process loss) and its ``critic/warmup``.
"""

import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from mmpo.algos.ppo import PPOModule
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, OptimConfig, SamplingConfig, ValueModelConfig
from mmpo.training.fsdp import FSDP2Strategy
from mmpo.training.lora import unwrap
from mmpo.vlm.fsdp import full_state_dict, is_sharded
from mmpo.vlm.rollout import HFGenerateEngine

torch.set_num_threads(1)
mode, model_path, out, steps, ckpt_dir, resume, optimizer = sys.argv[1:8]
WORLD = {"single": 1, "fsdp": 2}[mode]
parallel = WORLD > 1
rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
POLICY_LR, CRITIC_LR = 0.5, 0.2


def mine(tensor):
    """This rank's rows of a global (6, ...) tensor (all of them in one process)."""
    return tensor if not parallel else tensor[3 * dist.get_rank(): 3 * dist.get_rank() + 3]


class FixedPPO(PPOModule):
    """Every process builds the same global rollout (seeded); a data-parallel rank keeps its prompt's group."""

    def build_rollout(self, batch):
        torch.manual_seed(0)
        full = HFGenerateEngine(unwrap(self.model), self.processor).generate(rows, num_samples=3, max_new_tokens=6)
        # unequal lengths (as if EOS came early): rank 0 holds 12 tokens, rank 1 holds 6
        keep = torch.arange(6).unsqueeze(0) < torch.tensor([6, 2, 4, 1, 2, 3]).unsqueeze(1)
        full.completion_mask = full.completion_mask * keep
        full.completion_ids = full.completion_ids.masked_fill(~keep, 0)
        return full if not parallel else full.select(list(range(3 * self.global_rank, 3 * self.global_rank + 3)))

    def compute_rewards(self, rollout):
        return mine(REWARDS).clone(), {}

    def compute_advantages(self, rewards, group_ids, rollout):
        advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
        self.last_values = (rollout.extras["ppo_values"].clone(), rollout.extras["ppo_returns"].clone())
        return advantages, metrics

    def configure_optimizers(self):
        if optimizer == "adamw":
            return super().configure_optimizers()
        return torch.optim.SGD([{"params": list(self.model.parameters())},
                                {"params": list(self.value_model.parameters()), "lr": CRITIC_LR}],
                               lr=POLICY_LR, momentum=0.9)


module = FixedPPO(model_path, sampling=SamplingConfig(num_generations=3), loss=LossConfig(beta=0.0),
                  optim=OptimConfig(lr=1e-3, max_grad_norm=0.05, micro_batch_size=1 if parallel else None),
                  critic=ValueModelConfig(warmup_steps=1, cliprange_value=0.05, head_init_std=0.5, lr=1e-3),
                  gamma=1.0, lam=0.95, kl_coef=0.1, whiten_advantages=False, seed=1)
callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if ckpt_dir != "-" else []
trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=FSDP2Strategy() if parallel else "auto",
                    max_steps=int(steps), logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
batch = [rows[0]] if parallel else rows
trainer.fit(module, DataLoader([batch] * 2, batch_size=None, collate_fn=lambda x: x),
            ckpt_path=None if resume == "-" else resume)

assert is_sharded(module.model) == parallel and is_sharded(module.value_model.backbone) == parallel
assert is_sharded(module.reference_model) == parallel  # the KL-in-reward reference
metrics = module.last_metrics
totals = torch.tensor([metrics["losses/policy"], metrics["losses/value"]], dtype=torch.float64)
values, returns = module.last_values
if parallel:
    dist.all_reduce(totals)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, (values, returns))
    width = max(v.shape[1] for v, _ in gathered)  # each rank's rollout is padded to its own longest completion
    values = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v, _ in gathered])
    returns = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for _, r in gathered])
# every rank joins the gathers when sharded
state = {f"policy.{k}": v for k, v in full_state_dict(module.model).items()}
backbone, head = module.value_model.full_state()
backbone = backbone if backbone is not None else module.value_model.backbone.state_dict()
state.update({f"critic.backbone.{k}": v for k, v in backbone.items()})
state.update({f"critic.head.{k}": v for k, v in head.items()})
if trainer.is_global_zero:
    state.update(values=values, returns=returns)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, out)
    print("global_step", trainer.global_step, "policy_loss", f"{float(totals[0]):.9e}", "value_loss",
          f"{float(totals[1]):.9e}", "warmup", metrics["critic/warmup"], "grad_norm", metrics["policy/grad_norm"])
