"""SPO: Single-stream Policy Optimization (arXiv 2509.13232) for VLMs.

One response per prompt (G = 1). A persistent per-prompt Beta tracker (``mmpo.algos.spo_tracker``)
replaces the group baseline: ``A = r - p_hat``, normalised over the whole batch; after the update the
tracker forgets with a KL-adaptive factor ``rho`` and absorbs the reward. Prompts are drawn from each
loaded (generation) batch with priority ``sqrt(p_hat (1 - p_hat)) + 0.05``. Everything else is the
GRPO step (clipped loss, official clip 0.2 / 0.28, no KL). The tracker is saved in Lightning
checkpoints (``spo_tracker``), so a resumed run continues with the same estimates.

Official code: verl-recipe ``spo/`` (see docs/variants/spo.md for the defaults and what differs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require, step_seed
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import SamplingConfig, as_config
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.algos.spo_tracker import (
    RHO_TYPES,
    BetaTracker,
    kl_forgetting_rho,
    priority_weights,
    sample_prompts,
    spo_advantages,
)
from mmpo.training.gather import all_gather_objects
from mmpo.vlm.processing import select_rows
from mmpo.vlm.rollout import Rollout


def prompt_key(row: Mapping[str, Any]) -> str:
    """The tracker's key of a row: its ``id`` (the official code keys by prompt text)."""
    if "id" not in row:
        raise ValueError(f"SPO tracks prompts by row id; a row has no 'id' (keys: {sorted(row)})")
    return str(row["id"])


def load_offline_values(path: str | Path) -> dict[str, list[float]]:
    """``{prompt id: [offline rollout scores]}`` from a JSON file (the official ``offline_values``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"offline_values {str(path)!r} is not a readable JSON file: {err}") from err
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise ValueError(f"offline_values {str(path)!r} must map prompt id -> list of scores")
    return {str(k): [float(s) for s in v] for k, v in data.items()}


class SPOModule(CheckpointedState, GRPOModule):
    """GRPO's step with SPO's single stream, Beta-tracker baseline and prioritised prompts.

    Args:
        model_path: saved HF model directory.
        num_generations: responses per prompt; SPO is single-stream, so 1 (the only accepted value).
        rho_type: ``kl`` (forgetting from the drift of the prompt's last response, official default) or
            ``constant`` (``rho_value`` every step).
        rho_value: the constant forgetting factor of ``rho_type: constant`` (official 0.875).
        rho_min: lower clip of ``rho`` (official ``clip_lower`` 0.875); also sets the prior's weight 1 / (1 - rho_min).
        rho_max: upper clip of ``rho`` (official 0.96, hard-coded there).
        d_half: drift at which ``rho`` halves (official 0.06, hard-coded there).
        offline_values: JSON file ``{prompt id: [scores of offline rollouts]}`` for the prior; None = every
            prompt starts at alpha = beta = 0.5.
        offline_n: offline scores used per prompt (official 8); 0 = the 0.5 / 0.5 prior for all.
        train_batch_size: prompts drawn (by priority) from each loaded batch, with replacement only when more
            than the batch; None = train on the loaded batch as is (what the official sampler does when the
            generation and train batch sizes are equal).
        exploration_epsilon: the constant added to the priority weight (official 0.05).
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is not used: SPO's baseline replaces it).
    """

    checkpointed_state = (("spo_tracker", "tracker"),)

    min_generations = 1

    def __init__(
        self,
        model_path: str,
        *,
        sampling: SamplingConfig = SamplingConfig(num_generations=1),
        rho_type: str = "kl",
        rho_value: float = 0.875,
        rho_min: float = 0.875,
        rho_max: float = 0.96,
        d_half: float = 0.06,
        offline_values: str | None = None,
        offline_n: int = 8,
        train_batch_size: int | None = None,
        exploration_epsilon: float = 0.05,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, sampling=as_config(sampling, SamplingConfig(num_generations=1)), **kwargs)
        values = load_offline_values(offline_values) if offline_values else None
        self.tracker = BetaTracker(rho_min=rho_min, offline_n=offline_n, offline_values=values,
                                   seed=self.hparams.seed)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(self.sampling.num_generations == 1,
                f"SPO is single-stream: num_generations must be 1, got {self.sampling.num_generations}")
        require(h.rho_type in RHO_TYPES, f"unknown rho_type {h.rho_type!r}; valid: {list(RHO_TYPES)}")
        require(0 <= h.rho_min < 1, f"rho_min must be in [0, 1), got {h.rho_min}")
        require(h.rho_min <= h.rho_max <= 1, f"rho_max must be in [rho_min, 1], got {h.rho_max}")
        require(0 < h.rho_value <= 1, f"rho_value must be in (0, 1], got {h.rho_value}")
        require(h.d_half > 0, f"d_half must be > 0, got {h.d_half}")
        require(h.offline_n >= 0, f"offline_n must be >= 0, got {h.offline_n}")
        require(h.train_batch_size is None or h.train_batch_size >= 2,
                f"train_batch_size must be >= 2 (advantages are normalised over the batch) or None, "
                f"got {h.train_batch_size}")
        require(h.exploration_epsilon >= 0, f"exploration_epsilon must be >= 0, got {h.exploration_epsilon}")

    # ------------------------------------------------------------------ the step

    def prioritized_rows(self, rows: Sequence[Mapping[str, Any]], step: int) -> list[Mapping[str, Any]]:
        """``train_batch_size`` rows drawn from ``rows`` with probability proportional to their priority,
        seeded by (seed, step, rank) so a resumed run draws the same prompts."""
        h = self.hparams
        rows = list(rows)
        if h.train_batch_size is None:
            return rows
        weights = priority_weights(self.tracker.p_hat([prompt_key(r) for r in rows]),
                                   epsilon=h.exploration_epsilon)
        rank = 0 if self._trainer is None else self.global_rank
        generator = torch.Generator().manual_seed(step_seed(h.seed, step, rank) + 104729)
        return [rows[i] for i in sample_prompts(weights, h.train_batch_size, generator).tolist()]

    def begin_step(self, state: StepState) -> None:
        state.rows = self.prioritized_rows(state.rows, state.step)
        require(len(state.rows) >= 2,
                f"SPO normalises advantages over the batch: it needs >= 2 prompts, got {len(state.rows)}")

    def end_step(self, state: StepState) -> None:
        state.metrics.update(self.update_tracker(state.rollout, state.rewards))

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """``(r - p_hat)`` normalised over the batch, with the tracker as it stood before this step."""
        keys = [prompt_key(row) for row in rollout.rows]
        alpha, beta = self.tracker.params(keys)
        p_hat = alpha / (alpha + beta)
        raw = rewards.double().cpu() - p_hat
        # the official batch is the global one: under DDP normalise with every rank's raw advantages
        batch = torch.cat(all_gather_objects(raw))
        advantages = spo_advantages(rewards.double().cpu(), p_hat, batch=batch).to(rewards)
        return advantages, {
            "spo/p_hat_mean": float(p_hat.mean()), "spo/alpha_mean": float(alpha.mean()),
            "spo/beta_mean": float(beta.mean()), "spo/n_eff_mean": float((alpha + beta).mean()),
            "spo/adv_before_norm_mean": float((rewards.double().cpu() - p_hat).mean()),
        }

    @torch.no_grad()
    def update_tracker(self, rollout: Rollout, rewards: Tensor) -> dict[str, float]:
        """After the update: the forgetting factor of each prompt of ``rollout`` (this step's, with its
        ``rewards``), then the tracker's Beta update."""
        keys = [prompt_key(row) for row in rollout.rows]
        rewards = rewards.detach().double().cpu()
        h = self.hparams
        first = torch.tensor([k not in self.tracker.responses for k in keys], dtype=torch.float64)
        responses: dict[str, tuple[list[int], list[float]]] = {}
        if h.rho_type == "constant":
            drift = torch.zeros(len(keys), dtype=torch.float64)
            rho = torch.full((len(keys),), float(h.rho_value), dtype=torch.float64)
        else:
            drift, responses = self.response_drift(rollout, keys)
            rho = kl_forgetting_rho(drift, d_half=h.d_half, rho_min=h.rho_min, rho_max=h.rho_max)
        # every rank applies every rank's updates in rank order, so the trackers stay identical
        # (the official tracker lives on one driver process and sees the whole batch)
        for rank_keys, rank_rewards, rank_rho, rank_responses in all_gather_objects((keys, rewards, rho, responses)):
            self.tracker.update(rank_keys, rank_rewards, rank_rho)
            self.tracker.store_responses(rank_responses)
        raw = torch.pow(2.0, -drift / h.d_half) if h.rho_type == "kl" else rho
        return {"spo/rho_mean": float(rho.mean()), "spo/kl_drift_mean": float(drift.mean()),
                "spo/rho_clip_frac": float((raw != rho).double().mean()),
                "spo/first_visit_frac": float(first.mean()), "spo/tracked_prompts": float(len(self.tracker))}

    def response_drift(self, rollout: Rollout, keys: list[str]) -> tuple[Tensor, dict[str, tuple[list[int], list[float]]]]:
        """(N,) token-mean ``|log pi_stored - log pi_now|`` on each prompt's last stored response (0 on a
        first visit), and this step's responses with their log-probs under the updated policy (to store)."""
        micro = self.optim.micro_batch_size or len(rollout)
        now = self._log_probs_no_grad(self.model, rollout.to(self.device), micro).double().cpu()
        drift = torch.zeros(len(keys), dtype=torch.float64)
        seen = [i for i, k in enumerate(keys) if k in self.tracker.responses]
        if seen:
            past, stored_lp = self._stored_responses(rollout, [keys[i] for i in seen], seen)
            current = self._log_probs_no_grad(self.model, past.to(self.device), micro).double().cpu()
            mask = past.completion_mask.double()
            drift[seen] = ((stored_lp - current).abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        lengths = rollout.completion_mask.sum(-1).tolist()
        responses = {}
        for i, key in enumerate(keys):  # a prompt drawn twice keeps its last response (official loop order)
            n = int(lengths[i])
            responses[key] = (rollout.completion_ids[i, :n].tolist(), now[i, :n].tolist())
        return drift, responses

    def _stored_responses(self, rollout: Rollout, keys: list[str], positions: list[int]) -> tuple[Rollout, Tensor]:
        """The stored responses of ``keys`` as a rollout on the prompts at ``positions``, and their stored log-probs."""
        stored = [self.tracker.responses[k] for k in keys]
        width = max(1, max(len(ids) for ids, _ in stored))
        ids = torch.full((len(keys), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(keys), width), dtype=torch.long)
        log_probs = torch.zeros((len(keys), width), dtype=torch.float64)
        for j, (tokens, lp) in enumerate(stored):
            ids[j, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[j, : len(tokens)] = 1
            log_probs[j, : len(lp)] = torch.tensor(lp, dtype=torch.float64)
        past = Rollout(rows=[rollout.rows[i] for i in positions], group_ids=torch.arange(len(keys)),
                       prompt_inputs=select_rows(rollout.prompt_inputs, positions), completion_ids=ids,
                       completion_mask=mask, texts=[""] * len(keys))
        return past, log_probs

    # ------------------------------------------------------------------ checkpoints
