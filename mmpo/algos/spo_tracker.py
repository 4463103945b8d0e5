"""SPO's per-prompt Beta tracker and its formulas (Single-stream PO, arXiv 2509.13232).

Reference: the official code, verl-recipe ``spo/spo_ray_trainer.py`` (``fit`` and ``_get_spo_rho``),
re-derived here in torch (not copied):

- prior from offline rollouts (scores binarised ``> 0``, at most ``offline_n`` of them, ``s`` successes):
  ``N_init = 1 / (1 - rho_min)``, ``alpha0 = N_init (s + 0.5) / (N + 1)``, ``beta0 = N_init (N - s + 0.5) / (N + 1)``;
  ``alpha0 = beta0 = 0.5`` with ``offline_n = 0`` (and, in mmpo, for a prompt the offline file lacks);
- estimate ``p_hat = alpha / (alpha + beta)``; advantage ``A = r - p_hat`` (the tracker before this step),
  then normalised over the whole batch, ``(A - mean) / (std + 1e-8)`` (torch's unbiased std, as the code);
- after the update, forgetting ``rho = clip(2^(-D / D_half), rho_min, rho_max)`` where ``D`` is the
  token-mean ``|log pi_stored - log pi_now|`` on the prompt's last stored response (``D = 0`` on a first
  visit), then ``alpha <- rho alpha + r``, ``beta <- rho beta + (1 - r)``;
- prompt priority ``w = sqrt(p_hat (1 - p_hat)) + 0.05``.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

RHO_TYPES = ("kl", "constant")
EXPLORATION_EPSILON = 0.05  # official EXPLORATION_EPSILON of the prompt weights
ADV_EPS = 1e-8  # official epsilon of the batch normalisation


def kl_forgetting_rho(d: Tensor, *, d_half: float = 0.06, rho_min: float = 0.875, rho_max: float = 0.96) -> Tensor:
    """``clip(2^(-D / D_half), rho_min, rho_max)`` per prompt (official ``_get_spo_rho``, type ``kl``)."""
    return torch.clamp(torch.pow(2.0, -d / d_half), min=rho_min, max=rho_max)


def offline_prior(scores: Sequence[float], *, offline_n: int = 8, rho_min: float = 0.875,
                  rng: random.Random | None = None) -> tuple[float, float]:
    """``(alpha0, beta0)`` from one prompt's offline rollout scores (binarised ``> 0``).

    More than ``offline_n`` scores are subsampled to ``offline_n`` with ``rng`` (the official
    ``random.sample``); the official code divides by ``offline_n + 1`` even when fewer scores exist, kept here.
    """
    if offline_n == 0:
        return 0.5, 0.5
    wins = [int(float(s) > 0) for s in scores]
    if len(wins) > offline_n:
        wins = (rng or random.Random(0)).sample(wins, offline_n)
    n_init = 1.0 / (1.0 - rho_min)
    s = sum(wins)
    return n_init * (s + 0.5) / (offline_n + 1), n_init * (offline_n - s + 0.5) / (offline_n + 1)


def spo_advantages(rewards: Tensor, p_hat: Tensor, *, eps: float = ADV_EPS, batch: Tensor | None = None) -> Tensor:
    """``A = r - p_hat``, normalised with the mean and unbiased std of ``batch`` (the raw advantages of the
    whole, e.g. all-rank, batch; default: these), which needs >= 2 responses."""
    adv = rewards - p_hat
    batch = adv if batch is None else batch
    if batch.numel() < 2:
        raise ValueError(f"SPO normalises advantages over the batch: it needs >= 2 responses, got {batch.numel()}")
    return (adv - batch.mean()) / (batch.std() + eps)


def priority_weights(p_hat: Tensor, *, epsilon: float = EXPLORATION_EPSILON) -> Tensor:
    """Prompt sampling weight ``sqrt(p_hat (1 - p_hat)) + epsilon`` (largest for uncertain prompts)."""
    return torch.sqrt(p_hat * (1.0 - p_hat)) + epsilon


def sample_prompts(weights: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``k`` indices drawn with probability proportional to ``weights``; with replacement only when
    ``k`` exceeds the number of candidates (the official ``np.random.choice(replace=k > M)``)."""
    if weights.numel() == 0:
        raise ValueError("no prompts to sample from")
    probs = weights.double() if float(weights.sum()) > 0 else torch.ones_like(weights, dtype=torch.float64)
    return torch.multinomial(probs, k, replacement=k > weights.numel(), generator=generator)


class BetaTracker:
    """Per-prompt ``(alpha, beta)``, visit counts and (for ``kl`` forgetting) each prompt's last response.

    Keys are prompt ids (``row["id"]``; the official code keys by prompt text). State is plain
    Python (floats and int lists), so it goes into a Lightning checkpoint as is.
    """

    def __init__(self, *, rho_min: float = 0.875, offline_n: int = 8,
                 offline_values: Mapping[str, Sequence[float]] | None = None, seed: int = 0) -> None:
        self.alpha: dict[str, float] = {}
        self.beta: dict[str, float] = {}
        self.visits: dict[str, int] = {}
        # key -> (completion token ids, their log-probs under the policy right after that step's update)
        self.responses: dict[str, tuple[list[int], list[float]]] = {}
        rng = random.Random(seed)
        for key, scores in (offline_values or {}).items():
            self.alpha[str(key)], self.beta[str(key)] = offline_prior(scores, offline_n=offline_n, rho_min=rho_min,
                                                                      rng=rng)

    def params(self, keys: Sequence[str]) -> tuple[Tensor, Tensor]:
        """``(alpha, beta)`` of ``keys``; a key neither seen nor in the offline values has the
        ``N_eff = 0`` prior 0.5, 0.5 (reading does not add it)."""
        return (torch.tensor([self.alpha.get(k, 0.5) for k in keys], dtype=torch.float64),
                torch.tensor([self.beta.get(k, 0.5) for k in keys], dtype=torch.float64))

    def p_hat(self, keys: Sequence[str]) -> Tensor:
        alpha, beta = self.params(keys)
        return alpha / (alpha + beta)

    def store_responses(self, responses: Mapping[str, tuple[list[int], list[float]]]) -> None:
        """Keep each prompt's latest response (token ids, log-probs) for the next drift."""
        self.responses.update(responses)

    def update(self, keys: Sequence[str], rewards: Tensor, rho: Tensor) -> None:
        """``alpha <- rho alpha + r``, ``beta <- rho beta + (1 - r)`` from the values before this call;
        a key repeated in ``keys`` keeps its last position's result (as the official loop)."""
        alpha, beta = self.params(keys)
        r, rho = rewards.double().cpu(), rho.double().cpu()
        new_alpha, new_beta = rho * alpha + r, rho * beta + (1.0 - r)
        for i, key in enumerate(keys):
            self.alpha[key], self.beta[key] = float(new_alpha[i]), float(new_beta[i])
            self.visits[key] = self.visits.get(key, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": dict(self.alpha), "beta": dict(self.beta), "visits": dict(self.visits),
                "responses": {k: (list(ids), list(lp)) for k, (ids, lp) in self.responses.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"alpha", "beta", "visits", "responses"} - set(state)
        if missing:
            raise ValueError(f"SPO tracker state lacks {sorted(missing)}")
        self.alpha = {str(k): float(v) for k, v in state["alpha"].items()}
        self.beta = {str(k): float(v) for k, v in state["beta"].items()}
        self.visits = {str(k): int(v) for k, v in state["visits"].items()}
        self.responses = {str(k): (list(map(int, ids)), list(map(float, lp)))
                          for k, (ids, lp) in state["responses"].items()}

    def __len__(self) -> int:
        return len(self.alpha)

