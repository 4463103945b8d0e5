"""SFPO's slow-fast update around any policy loss (arXiv 2510.04072; official code ``Urheen/SFPO``,
``Code/SFPO/verl/workers/fsdp_workers.py`` ``sfpo_update_actor`` and ``verl/trainer/ppo/ray_trainer.py``).

One SFPO step on a batch, given ``update()`` = one full ordinary update on that batch (all its epochs
and minibatches, old log-probs fixed to the policy before the step):

1. fast trajectory: ``update()`` K times from theta_0 to theta_K (the optimizer state carries over);
2. reposition: theta~ = theta_0 + alpha (theta_K - theta_0), on the trainable parameters;
3. slow correction: ``update()`` once more from theta~; its statistics are the step's.

Entropy switch (:class:`EntropyZScoreSwitch`): before each step, once W entropies are recorded, the
z-score of the latest against the last W, z = (H_last - mean) / (std + 1e-9) (population std),
switches SFPO off for good when z >= threshold; later steps are plain single updates.

Pure torch on parameter lists, so it wraps the VLM, masked-diffusion and DPPO updates alike.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, TypeVar

import torch

T = TypeVar("T")


@torch.no_grad()
def reposition(params: list[torch.Tensor], slow: list[torch.Tensor], alpha: float) -> None:
    """In place: p <- slow + alpha (p - slow) for each trainable parameter p (p holds the fast weights).

    ``torch.lerp`` computes it, exactly p at alpha = 1 (slow + (p - slow) can round off p)."""
    for param, start in zip(params, slow, strict=True):
        param.copy_(torch.lerp(start, param, alpha))


def slow_fast_update(params: Iterable[torch.Tensor], update: Callable[[], T], *, inner_steps: int, alpha: float) -> T:
    """Run SFPO's K fast updates, the reposition by ``alpha`` and the slow update; return the slow update's result.

    Args:
        params: the trainable parameters (``requires_grad``) that ``update`` changes.
        update: one ordinary update on the batch (its optimizer steps included).
        inner_steps: K >= 1 fast updates (official 3).
        alpha: reposition step size in (0, 1] (official 0.8); 1 keeps the fast weights.
    """
    if inner_steps < 1:
        raise ValueError(f"SFPO inner_steps (K) must be >= 1, got {inner_steps}")
    if not 0 < alpha <= 1:
        raise ValueError(f"SFPO alpha must be in (0, 1], got {alpha}")
    params = [p for p in params if p.requires_grad]
    with torch.no_grad():
        slow = [p.detach().clone() for p in params]
    for _ in range(inner_steps):
        update()
    reposition(params, slow, alpha)
    return update()


class EntropyZScoreSwitch:
    """SFPO's permanent switch-off when the policy entropy jumps (official ``zscore_w`` / ``zscore_threshold``).

    Args:
        window: W, entropies the z-score is taken over (official 30).
        threshold: switch off when z >= threshold (official 1.0).
    """

    def __init__(self, window: int = 30, threshold: float = 1.0) -> None:
        if window < 2:
            raise ValueError(f"SFPO z-score window must be >= 2, got {window}")
        self.window = window
        self.threshold = threshold
        self.entropies: list[float] = []
        self.stopped = False
        self.last_z = math.nan

    def zscore(self) -> float:
        """z of the latest recorded entropy against the last W (NaN with fewer than W recorded)."""
        if len(self.entropies) < self.window:
            return math.nan
        recent = torch.tensor(self.entropies[-self.window:], dtype=torch.float64)
        std = float(recent.std(unbiased=False)) + 1e-9
        return (self.entropies[-1] - float(recent.mean())) / std

    def check(self) -> bool:
        """Before a step: update the switch from the history; True while SFPO stays on."""
        self.last_z = self.zscore()
        if not math.isnan(self.last_z) and self.last_z >= self.threshold:
            self.stopped = True
        return not self.stopped

    def record(self, entropy: float) -> None:
        """After a step: the token-mean entropy of its (slow, or plain) update."""
        self.entropies.append(float(entropy))
        del self.entropies[: -self.window]  # only the last W are ever read

    def state_dict(self) -> dict[str, object]:
        return {"entropies": list(self.entropies), "stopped": self.stopped}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.entropies = [float(v) for v in state["entropies"]]  # type: ignore[union-attr]
        self.stopped = bool(state["stopped"])
