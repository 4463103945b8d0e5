"""Regenerate dppo_golden.json: DPPO's minibatch loss and gradients on a fixed tiny batch.

A seeded tiny diffusion policy (one BC step from seeded data, so it is a real checkpoint) is
fine-tuned by ``mmpo.robotics.dppo.DPPOModule`` with K' = 5 denoising steps and the per-step clip
schedule eps_i = 0.1 -> 0.2 (rate 3). On a fixed minibatch of (env step, denoising step) pairs,
with old log-probs set off from the current ones by seeded noise (so the per-step clip bounds
bind on some pairs), it stores ``minibatch_loss``'s policy and value losses, ratios and metrics,
and per parameter of the fine-tuned actor and the critic a fingerprint (sum, sum of squares,
fixed random projection) of the gradient of ``policy + vf_coef * value``, all in float64.
``tests/robotics/test_golden.py`` recomputes and compares. Regenerate only for an intended change
of a formula, and say so in the commit message:

    python tests/robotics/golden/make_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmpo.robotics.bc import BCModule
from mmpo.robotics.dppo import DPPOModule
from mmpo.robotics.policy.dppo_math import reduce_step_log_prob

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: golden_support
from golden_support import gradient_fingerprint  # noqa: E402

GOLDEN_PATH = HERE / "dppo_golden.json"
FT_STEPS, ACT_STEPS, PAIRS = 5, 2, 20
SETTINGS = dict(chain={"ft_steps": FT_STEPS, "clip_base": 0.1, "clip_final": 0.2, "clip_rate": 3.0, "gamma_denoise": 0.99,
                       "min_logprob_std": 0.1},
                critic={"vf_coef": 0.5, "hidden_dims": [16, 16]}, env={"num_envs": 2, "n_steps": 2},
                returns={"reward_scale_running": False})


def build_checkpoint(root: Path) -> Path:
    """A seeded tiny BC policy (obs 2, action 1, horizon 2, 5 denoising steps) after one BC step."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(16, 2, generator=generator) * 2 - 1
    actions = torch.rand(16, 2, 1, generator=generator) * 2 - 1
    module = BCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=ACT_STEPS, denoising_steps=5, hidden_dims=[16, 16],
                      lr=1e-3, lr_min=1e-3, warmup_steps=1, export_safetensors=False, task="reach")
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=root)
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=16))
    path = root / "bc.ckpt"
    trainer.save_checkpoint(path)
    return path


def compute(checkpoint: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = DPPOModule(str(checkpoint), **SETTINGS).double()
    generator = torch.Generator().manual_seed(1)
    policy = module.policy
    obs = torch.rand(PAIRS, 2, generator=generator, dtype=torch.float64) * 2 - 1
    chains = torch.randn(PAIRS, FT_STEPS + 1, policy.horizon, 1, generator=generator, dtype=torch.float64)
    ft_index = torch.arange(FT_STEPS).repeat(PAIRS // FT_STEPS)
    advantages = torch.randn(PAIRS, generator=generator, dtype=torch.float64)
    returns = torch.randn(PAIRS, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        current = reduce_step_log_prob(
            policy.chain_step_log_prob(obs, chains, ft_index, min_logprob_std=module.chain.min_logprob_std),
            module.act_steps, module.chain.logprob_min, module.chain.logprob_max)
    old = current + 0.15 * torch.randn(PAIRS, generator=generator, dtype=torch.float64)
    pg_loss, value_loss, ratio, metrics = module.minibatch_loss(obs, chains, ft_index, old, advantages, returns)
    (pg_loss + module.critic_config.vf_coef * value_loss).backward()
    params = {f"actor.{n}": p for n, p in policy.ft_network.named_parameters()}
    params.update({f"critic.{n}": p for n, p in module.critic.named_parameters()})
    return {
        "losses/policy": pg_loss.item(), "losses/value": value_loss.item(), "ratio": ratio.tolist(),
        "metrics": {k: float(v) for k, v in sorted(metrics.items())},
        "clip_ranges": module.clip_ranges.tolist(),
        "grad": {n: gradient_fingerprint(p.grad, n, p.shape) for n, p in params.items()},
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        payload = compute(build_checkpoint(Path(tmp)))
    GOLDEN_PATH.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH}")
