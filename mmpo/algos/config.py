"""Small shared pieces of the VLM Lightning modules: checks, optimizer + schedule, RNG state.

Kept here so SFTModule and GRPOModule (and the algorithms that subclass GRPOModule)
validate and checkpoint the same way.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpo.training.export_guard import ExportOwnershipMixin
from mmpo.training.optim import make_optimizer  # noqa: F401  (re-exported: the VLM modules' old import path)


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (config validation with clear messages)."""
    if not condition:
        raise ValueError(message)


def refuse_rollout_correction(correction: Any) -> None:
    """Structured rollouts (BRPO, TreePO, T-PPO) sample continuations outside the engine's ``generate``,
    which alone records the engine's log-probs: refuse a ``rollout_correction`` (its ``mode`` or ``bypass``,
    a :class:`~mmpo.training.config.RolloutCorrectionConfig`) before the model loads."""
    require(correction.mode is None and not correction.bypass,
            "rollout_is / rollout_bypass need the engine's log-probs of every token; this variant's structured "
            "rollout does not record them: set rollout_is null and rollout_bypass false")


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, used to list the valid values in error messages."""
    return [d for d in range(1, n + 1) if n % d == 0]


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU + CUDA) RNG states, for checkpoints.

    Only tensors and plain Python types, so checkpoints load with ``torch.load(weights_only=True)``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for one training step's sampling: a function of (seed, step, rank) only.

    Sampling is then reproducible after a resume (it does not depend on how much
    randomness earlier steps consumed) and different on every data-parallel rank.
    """
    return (seed * 1_000_003 + step * 10_007 + rank * 101) % (2**63 - 1)


def greedy_validation_metrics(engine: Any, rows: list, *, max_new_tokens: int, timeout_s: float | None) -> dict[str, float]:
    """Greedy decoding on held-out rows -> ``val/accuracy`` and ``val/format`` (means over ``rows``)."""
    from mmpo.rewards import compute_rewards

    rollout = engine.generate(rows, num_samples=1, max_new_tokens=max_new_tokens, do_sample=False)
    _, per_fn, _ = compute_rewards({"accuracy": 1.0, "format": 1.0}, rollout.texts, rollout.rows, timeout_s=timeout_s)
    return {"val/accuracy": float(per_fn["accuracy"].mean()), "val/format": float(per_fn["format"].mean())}


class VLMCheckpointHooks(ExportOwnershipMixin):
    """Checkpoint hooks shared by the VLM Lightning modules (mixed in before LightningModule).

    Lightning checkpoints carry the python/numpy/torch RNG streams (so a resumed run samples the
    same rollouts) and the run id, and the policy is also exported in HF format (``save_pretrained``)
    so the next stage and ``mmpo eval`` can load it with ``load_vlm``. An export directory belongs
    to one run (``mmpo.training.export_guard``): another run's export is refused before training
    starts unless ``overwrite_output``. Expects ``self.model``, ``self.processor`` and hparams
    ``output_dir`` / ``save_hf_on_checkpoint`` / ``overwrite_output``.
    """

    def export_dir(self) -> str | None:
        return self.hparams.output_dir

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["mmpo_rng"] = rng_state()
        super().on_save_checkpoint(checkpoint)
        if self.hparams.save_hf_on_checkpoint:
            self.save_hf()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "mmpo_rng" in checkpoint:
            set_rng_state(checkpoint["mmpo_rng"])
        super().on_load_checkpoint(checkpoint)

    def on_fit_end(self) -> None:
        self.save_hf()

    def save_hf(self, output_dir: str | Path | None = None) -> Path | None:
        """Write model + processor in HF format (global rank 0 only) so ``load_vlm`` can read them."""
        from mmpo.vlm.factory import save_vlm

        from mmpo.vlm.fsdp import full_state_dict, is_sharded

        output_dir = output_dir or self.hparams.output_dir
        if output_dir is None:
            return None
        # FSDP2: every rank takes part in gathering the full weights; rank 0 writes them
        state_dict = full_state_dict(self.model) if is_sharded(self.model) else None
        if self._trainer is not None and not self.trainer.is_global_zero:
            return None
        self.claim_export_dir(output_dir)
        path = save_vlm(self.model, self.processor, output_dir, state_dict=state_dict)
        self.mark_export_dir(path)
        return path
