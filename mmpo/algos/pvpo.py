"""PVPO: Pre-estimated Value-based Policy Optimization (arXiv 2508.21104) for VLMs.

Before training, the reference policy (the initial policy) rolls out every training prompt
``ref_rollouts`` times (one offline pass). Per prompt this gives

- the static value ``V_hat(q)`` = mean reward of those rollouts, the baseline of the advantage
  ``A_i = r_i - V_hat(q)`` (core estimator ``pvpo``), independent of the current group;
- the reference accuracy (mean ``accuracy`` reward): prompts the reference always solves
  (accuracy >= ``trivial_accuracy``, 1.0) leave the loss; for prompts it never solves (accuracy 0),
  when the row carries an ``expert_trace`` (the paper: a ground-truth trajectory from a larger
  LLM), that trace replaces the group's last sampled completion.

Every ``refresh_every`` steps the pass runs again with the policy as it is then (the reference is
refreshed). The table (values, accuracies, the step of the last pass) goes into Lightning
checkpoints (``pvpo_baselines``), so a resumed run neither re-runs the pass nor changes the baseline.

No official code was found; see docs/variants/pvpo.md for the points that are unverified.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require, step_seed
from mmpo.algos.grpo import GRPOModule
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.core import compute_advantages_with_metrics
from mmpo.rewards import compute_rewards
from mmpo.training.gather import all_gather_objects
from mmpo.vlm.processing import encode_completions
from mmpo.vlm.rollout import Rollout

log = logging.getLogger(__name__)


def prompt_key(row: Mapping[str, Any]) -> str:
    """The table's key of a row: its ``id``."""
    if "id" not in row:
        raise ValueError(f"PVPO keys its baseline table by row id; a row has no 'id' (keys: {sorted(row)})")
    return str(row["id"])


class BaselineTable:
    """Per-prompt static value and reference accuracy, and the step of the last reference pass."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.accuracy: dict[str, float] = {}
        self.refreshed_at: int | None = None  # optimizer step of the last full pass (None: none yet)

    def record(self, keys: Sequence[str], rewards: Tensor, accuracy: Tensor, group_ids: Tensor) -> None:
        """Mean reward and mean accuracy per prompt from its reference rollouts (``group_ids`` index ``keys``)."""
        for g, key in enumerate(keys):
            members = group_ids == g
            self.values[key] = float(rewards[members].double().mean())
            self.accuracy[key] = float(accuracy[members].double().mean())

    def lookup(self, keys: Sequence[str]) -> tuple[Tensor, Tensor]:
        missing = [k for k in keys if k not in self.values]
        if missing:
            raise KeyError(f"no static value for prompts {missing[:5]}: run the reference pass first")
        return (torch.tensor([self.values[k] for k in keys], dtype=torch.float32),
                torch.tensor([self.accuracy[k] for k in keys], dtype=torch.float32))

    def entries(self, keys: Sequence[str]) -> dict[str, tuple[float, float]]:
        """``{key: (value, accuracy)}`` of the known ``keys``."""
        return {k: (self.values[k], self.accuracy[k]) for k in keys if k in self.values}

    def merge(self, tables: Sequence[Mapping[str, tuple[float, float]]]) -> None:
        """Add the entries of ``tables`` (e.g. every rank's), later tables winning a clash."""
        for table in tables:
            for key, (value, accuracy) in table.items():
                self.values[key], self.accuracy[key] = float(value), float(accuracy)

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def __len__(self) -> int:
        return len(self.values)

    def state_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "accuracy": dict(self.accuracy), "refreshed_at": self.refreshed_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"values", "accuracy", "refreshed_at"} - set(state)
        if missing:
            raise ValueError(f"PVPO baseline state lacks {sorted(missing)}")
        self.values = {str(k): float(v) for k, v in state["values"].items()}
        self.accuracy = {str(k): float(v) for k, v in state["accuracy"].items()}
        self.refreshed_at = None if state["refreshed_at"] is None else int(state["refreshed_at"])


class PVPOModule(CheckpointedState, GRPOModule):
    """GRPO's step with PVPO's static baseline, trivial-prompt filter and expert injection.

    Args:
        model_path: saved HF model directory.
        ref_rollouts: reference rollouts per prompt in each pass (M); None = ``num_generations``.
        refresh_every: re-run the reference pass over the training prompts every this many optimizer
            steps with the policy of that moment; 0 = never (a static V for the whole run).
        offline_pass: run the pass over every training prompt when training starts (the paper's
            pre-rollout); False = estimate each prompt the first time a batch holds it.
        trivial_accuracy: prompts whose reference accuracy is at least this leave the loss (1.0: the
            always-solved ones); None = keep every prompt.
        inject_expert: for prompts of reference accuracy 0 whose row has an ``expert_trace``, that trace
            replaces the group's last sampled completion (scored and trained like the others).
        pass_batch_size: prompts per ``generate`` call of the reference pass.
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is ``pvpo``).
    """

    checkpointed_state = (("pvpo_baselines", "baselines"),)

    def __init__(
        self,
        model_path: str,
        *,
        advantage: AdvantageConfig = AdvantageConfig(name="pvpo"),
        ref_rollouts: int | None = None,
        refresh_every: int = 0,
        offline_pass: bool = True,
        trivial_accuracy: float | None = 1.0,
        inject_expert: bool = True,
        pass_batch_size: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, advantage=as_config(advantage, AdvantageConfig(name="pvpo")), **kwargs)
        self.baselines = BaselineTable()

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(self.advantage.name == "pvpo",
                f"PVPOModule's advantage is 'pvpo' (the static baseline), got {self.advantage.name!r}")
        require(h.ref_rollouts is None or h.ref_rollouts >= 1, f"ref_rollouts must be >= 1 or None, got {h.ref_rollouts}")
        require(h.refresh_every >= 0, f"refresh_every must be >= 0 (0 = never), got {h.refresh_every}")
        require(h.trivial_accuracy is None or 0 < h.trivial_accuracy <= 1,
                f"trivial_accuracy must be in (0, 1] or None, got {h.trivial_accuracy}")
        require(h.pass_batch_size >= 1, f"pass_batch_size must be >= 1, got {h.pass_batch_size}")
        require(not (h.inject_expert and (self.rollout_correction.mode is not None or self.rollout_correction.bypass)),
                "inject_expert adds completions the engine did not sample (no engine log-probs): "
                "it cannot be combined with rollout_is / rollout_bypass")

    # ------------------------------------------------------------------ the reference pass

    @torch.no_grad()
    def estimate_baselines(self, rows: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
        """Roll out ``rows`` M times each with the current policy and record value and accuracy.

        Seeded by (seed, step, chunk) and not by rank, so every data-parallel rank builds the same table.
        """
        h = self.hparams
        m = h.ref_rollouts or self.sampling.num_generations
        unique: dict[str, Mapping[str, Any]] = {}
        for row in rows:
            unique.setdefault(prompt_key(row), row)
        keys = list(unique)
        for start in range(0, len(keys), h.pass_batch_size):
            chunk = keys[start : start + h.pass_batch_size]
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(step_seed(h.seed, step, 0) + 31337 + start)
                rollout = self.engine.generate([unique[k] for k in chunk], num_samples=m,
                                               max_new_tokens=self.sampling.max_new_tokens,
                                               temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                               do_sample=True)
            rewards, accuracy = self._reward_and_accuracy(rollout)
            self.baselines.record(chunk, rewards, accuracy, rollout.group_ids)
        return {"pvpo/pass_prompts": float(len(keys)), "pvpo/pass_rollouts": float(len(keys) * m)}

    def _reward_and_accuracy(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(N,) training reward and (N,) ``accuracy`` reward of a rollout."""
        weights = dict(self.reward_weights)
        if "accuracy" not in weights:
            weights["accuracy"] = 0.0  # scored for the difficulty filter only
        total, per_fn, _ = compute_rewards(weights, rollout.texts, rollout.rows, timeout_s=self.rewards.timeout_s)
        return total, per_fn["accuracy"]

    def _training_rows(self) -> list[Mapping[str, Any]]:
        dataset = self.trainer.train_dataloader.dataset
        return [dataset[i] for i in range(len(dataset))]

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.hparams.offline_pass and self.baselines.refreshed_at is None:  # not when resumed
            metrics = self.estimate_baselines(self._training_rows(), self.trainer.global_step)
            self.baselines.refreshed_at = self.trainer.global_step
            log.info("PVPO reference pass: %d prompts x %d rollouts", metrics["pvpo/pass_prompts"],
                     metrics["pvpo/pass_rollouts"] / max(metrics["pvpo/pass_prompts"], 1))

    def begin_step(self, state: StepState) -> None:
        """Refresh the baseline table when due and estimate the prompts it lacks, before the rollout."""
        h = self.hparams
        step, batch = state.step, state.rows
        metrics: dict[str, float] = {}
        due = h.refresh_every > 0 and self.baselines.refreshed_at is not None and \
            step - self.baselines.refreshed_at >= h.refresh_every
        if due:
            rows = self._training_rows() if h.offline_pass else [r for r in batch]
            if not h.offline_pass:  # lazily estimated tables refresh what they hold, batch by batch
                self.baselines = BaselineTable()
            metrics.update(self.estimate_baselines(rows, step))
            self.baselines.refreshed_at = step
        new = [row for row in batch if prompt_key(row) not in self.baselines]
        if new:
            metrics.update(self.estimate_baselines(new, step))
        if self.baselines.refreshed_at is None:
            self.baselines.refreshed_at = step
        # lazily estimated prompts (and a lazy refresh) are per rank: share them, so every rank (and the
        # checkpoint rank 0 writes) holds the whole table; a no-op in one process
        self.baselines.merge(all_gather_objects(self.baselines.entries([prompt_key(r) for r in batch])))
        state.metrics.update(metrics)

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """G sampled completions per row; with ``inject_expert``, the last one of each never-solved prompt
        that has an expert trace is that trace."""
        rollout = super().build_rollout(rows)
        if not self.hparams.inject_expert:
            return rollout
        _, accuracy = self.baselines.lookup([prompt_key(r) for r in rows])
        targets = [g for g, row in enumerate(rows) if float(accuracy[g]) <= 0 and row.get("expert_trace")]
        if not targets:  # the mark is always present, so retried rollouts concatenate (DAPO refill)
            rollout.extras["pvpo_injected"] = torch.zeros(len(rollout), dtype=torch.bool)
            return rollout
        last = {int(g): i for i, g in enumerate(rollout.group_ids.tolist())}  # group -> its last position
        positions = [last[g] for g in targets]
        traces = [rows[g]["expert_trace"] for g in targets]
        return inject_completions(rollout, positions, traces, self.processor, max_length=self.sampling.max_new_tokens)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """``r - V_hat(q)``; trivial prompts get advantage 0 and leave the loss (their completion mask is
        zeroed in place, as dynamic sampling masks rather than removes, so ranks keep equal batch sizes)."""
        values, accuracy = self.baselines.lookup([prompt_key(r) for r in rollout.rows])
        advantages, metrics = compute_advantages_with_metrics(
            "pvpo", rewards, group_ids, static_values=values.to(rewards.device))
        injected = rollout.extras.get("pvpo_injected")
        metrics["pvpo/injected_frac"] = float(injected.float().mean()) if injected is not None else 0.0
        if self.hparams.trivial_accuracy is not None:
            trivial = accuracy >= self.hparams.trivial_accuracy
            if bool(trivial.any()):
                rollout.completion_mask.mul_((~trivial).to(rollout.completion_mask.dtype).unsqueeze(-1))
                advantages = advantages.masked_fill(trivial.to(advantages.device), 0.0)
            metrics["pvpo/trivial_frac"] = float(trivial.float().mean())
        metrics["pvpo/static_value_mean"] = float(values.mean())
        metrics["pvpo/ref_accuracy_mean"] = float(accuracy.mean())
        return advantages, metrics

    # ------------------------------------------------------------------ checkpoints


def inject_completions(rollout: Rollout, positions: Sequence[int], texts: Sequence[str], processor: Any, *,
                       max_length: int) -> Rollout:
    """``rollout`` with the completions at ``positions`` replaced by ``texts`` (tokenised with EOS,
    cut to ``max_length``); the prompts stay. ``extras["pvpo_injected"]`` marks the replaced ones."""
    ids, mask = encode_completions(processor, list(texts), max_length=max_length)
    width = max(rollout.completion_ids.shape[1], ids.shape[1])
    pad_id = int(processor.tokenizer.pad_token_id)
    completion_ids = torch.full((len(rollout), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rollout), width), dtype=rollout.completion_mask.dtype)
    completion_ids[:, : rollout.completion_ids.shape[1]] = rollout.completion_ids
    completion_mask[:, : rollout.completion_mask.shape[1]] = rollout.completion_mask
    new_texts = list(rollout.texts)
    injected = torch.zeros(len(rollout), dtype=torch.bool)
    for j, pos in enumerate(positions):
        completion_ids[pos] = pad_id
        completion_mask[pos] = 0
        completion_ids[pos, : ids.shape[1]] = ids[j]
        completion_mask[pos, : mask.shape[1]] = mask[j].to(completion_mask.dtype)
        new_texts[pos] = texts[j]
        injected[pos] = True
    return Rollout(rows=rollout.rows, group_ids=rollout.group_ids, prompt_inputs=rollout.prompt_inputs,
                   completion_ids=completion_ids, completion_mask=completion_mask, texts=new_texts,
                   extras={**rollout.extras, "pvpo_injected": injected})
