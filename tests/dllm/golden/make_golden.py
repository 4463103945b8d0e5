"""Regenerate dllm_golden.json: one IGPO (DiffuGRPO) training step on a fixed tiny batch.

A seeded tiny ModernBERT mask predictor (float64) runs one Lightning training step of
``mmpo.dllm.rl.DiffuGRPO`` with scripted rollouts: group 0 has one correct completion, group 1 none,
so IGPO regenerates group 1 with hints, swaps a correct hinted completion in, and the hint-entropy
filter, the clipped ratio (sequence-level, as the official run, or token-level with structured
masking), the k3 KL and the inner updates all enter the step. SGD(lr=1) and no gradient clipping
make the weight change minus the summed gradients. Stored: the logged metrics and, per parameter,
a gradient fingerprint (sum, sum of squares, fixed random projection). ``tests/dllm/test_golden.py``
recomputes and compares. Regenerate only for an intended change of a formula, and say so in the
commit message:

    python tests/dllm/golden/make_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import mmpo.dllm.rl as rl
from mmpo.dllm.hints import HintConfig
from mmpo.dllm.modeling import TinyMaskPredictorConfig, build_tiny_mask_predictor, save_mask_predictor
from mmpo.dllm.rollout import Rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.dllm.task import ArithmeticTaskConfig, corpus
from mmpo.dllm.tokenizer import train_char_tokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: golden_support
from golden_support import gradient_fingerprint  # noqa: E402

GOLDEN_PATH = HERE / "dllm_golden.json"
GEN = 8
ROWS = [{"problem": "1+2", "trace": "1+2=3\nA:3", "answer": "3"},
        {"problem": "2*2", "trace": "2*2=4\nA:4", "answer": "4"}]
PLAIN = ["1+2=3\nA:3", "1+2=4\nA:4", "1+2=5", "2*2=5\nA:5", "2*2=6", "A:7"]  # group 1 all wrong
HINTED = ["2*2=4\nA:4", "2*2=9\nA:9", "2*2=4\nA:4"]  # two hinted completions are right
CONFIGS: dict[str, dict[str, Any]] = {
    # the official IGPO run: sequence-level ratio over all positions, full masking, KL to the start
    "igpo_sequence": dict(loss={"name": "igpo_sequence", "beta": 0.01, "clip_low": 0.2, "clip_high": 0.2}),
    # token-level ratio (ppo) with IGPO's structured (partial) masking timesteps
    "igpo_token_structured": dict(loss={"name": "ppo", "beta": 0.01, "clip_low": 0.2, "clip_high": 0.28},
                                  logprob={"masking": "structured", "diffusion_steps": 16, "min_timestep": 3}),
}


def build_model(root: Path) -> Path:
    """The seeded tiny mask predictor and char tokenizer every configuration starts from."""
    torch.manual_seed(0)
    tokenizer = train_char_tokenizer(corpus(ArithmeticTaskConfig(), size=200))
    model = build_tiny_mask_predictor(
        tokenizer, TinyMaskPredictorConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                           max_positions=64))
    save_mask_predictor(model, tokenizer, root)
    return root


def _scripted_rollout(model, tokenizer, problems, config, *, fixed_tokens=None, fixed_mask=None, generator=None):
    """Known completion texts (tokenised for real), hint tokens kept at the fixed positions."""
    texts = HINTED if fixed_tokens is not None else PLAIN
    assert len(texts) == len(problems)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in problems]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:GEN] for t in texts]
    completions = torch.tensor([i + [tokenizer.eos_token_id] * (GEN - len(i)) for i in ids])
    fixed = torch.zeros(len(texts), GEN, dtype=torch.bool) if fixed_mask is None else fixed_mask.clone()
    if fixed_tokens is not None:
        completions = torch.where(fixed, fixed_tokens, completions)
    return Rollout(prompt_ids, prompt_mask, completions, fixed, list(texts))


class ScriptedIGPO(rl.DiffuGRPO):
    """SGD(lr=1): the weight change of a step is minus its summed gradients."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1.0)


def run(name: str, model_path: Path, save_dir: Path) -> dict[str, Any]:
    """One training step of configuration ``name``: {"metrics": {...}, "grad": {param: [sum, sumsq, proj]}}."""
    settings = dict(model_path=str(model_path), warmup_config=None, save_dir=str(save_dir), dtype="float64",
                    group_size=3, optim={"mu": 2, "max_grad_norm": 1e9},
                    igpo={"max_replacements": 1, "entropy_keep": 0.5},
                    sampler=SamplerConfig(gen_length=GEN, block_length=8, steps=4),
                    hints=HintConfig(min_chunk=1, max_chunk=2, free_tail=1), seed=0)
    original = rl.rollout
    rl.rollout = _scripted_rollout
    try:
        torch.manual_seed(0)
        module = ScriptedIGPO(**{**settings, **CONFIGS[name]})
        before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader([ROWS], batch_size=None, collate_fn=lambda x: x))
    finally:
        rl.rollout = original
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    grads = {n: gradient_fingerprint(before[n] - p.detach(), n) for n, p in module.model.named_parameters()}
    return {"metrics": dict(sorted(metrics.items())), "grad": grads}


def compute(model_path: Path, save_dir: Path) -> dict[str, Any]:
    return {name: run(name, model_path, save_dir / name) for name in CONFIGS}


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        payload = compute(build_model(Path(tmp) / "start"), Path(tmp) / "out")
    GOLDEN_PATH.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH}")
