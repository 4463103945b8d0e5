"""The one policy-update engine every family trains through.

A family (VLM / text LM, masked-diffusion LM, diffusion or Gaussian robot policy) supplies how a
micro-batch is scored: its new log-probs (and entropy when asked) for its items, token sequences,
masked-diffusion estimates, denoising chains or Gaussian actions, and its own extra loss terms.
This module does the rest, once:

* :class:`UpdateSchedule`: epochs x minibatches (shuffled by a seeded generator, or in order) over a
  batch of items; a minibatch is one optimizer step, split into micro-batches by the caller.
* :func:`core_loss_parts`: the core policy loss (``mmpo.core.policy_loss``) + beta x KL to a
  reference - entropy_coef x entropy, as named :class:`~mmpo.core.LossParts`, with the global
  token / sequence normalisers of an :class:`~mmpo.core.Aggregation`.
* :func:`micro_batch_metrics`: the ``losses/*`` and ``policy/*`` metrics of one micro-batch, summed over
  a step's micro-batches by the engine (one metric vocabulary for every family).
* :class:`UpdateEngine`: one optimizer step: zero the gradients, backward every micro-batch's loss
  (scaled by ``loss_scale``: the world size when the loss is normalised by global counts, so that
  DDP's gradient average becomes the sum), clip the gradient norm per parameter group, the
  non-finite guard (a non-finite loss or gradient norm drops the gradients, the step changes
  nothing), the optimizer step(s) and the learning-rate scheduler step. This is the only place a
  policy update clips gradients or steps an optimizer.
* :class:`UpdateWrapper`: a variant that changes how one whole update pass runs (SFPO's slow-fast
  update) wraps :meth:`UpdateEngine.run_pass`, the same object for every family.

verl splits the same job between ``dp_actor.update_policy`` and ``core_algos``; TRL's
``GRPOTrainer`` inherits it from ``transformers.Trainer``. Neither serves a Lightning module with
several optimizers (DPPO's actor and critic), so the loop is written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import Tensor

from mmpo.core import Aggregation, LossParts, kl_penalty, policy_loss

MicroBatch = TypeVar("MicroBatch")


# ---------------------------------------------------------------------- epochs x minibatches


@dataclass(frozen=True)
class UpdateSchedule:
    """How one update pass walks a batch of ``size`` items.

    Attributes:
        size: items in the batch (completions, (env step, denoising step) pairs, ...).
        minibatch_size: items per optimizer step (clamped to ``size``).
        epochs: passes over the batch (PPO's mu, ``OptimConfig.mu``; DPPO's old ``update_epochs``).
        shuffle: draw a fresh permutation per epoch from the generator; False walks the items in order
            and draws nothing (an on-policy single step).
        drop_last: skip a last partial minibatch (DPPO's official code does); otherwise it is kept.
    """

    size: int
    minibatch_size: int
    epochs: int = 1
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or self.minibatch_size < 1 or self.epochs < 1:
            raise ValueError(f"size, minibatch_size and epochs must be >= 1, got {self}")

    @property
    def minibatches_per_epoch(self) -> int:
        size = min(self.minibatch_size, self.size)
        return self.size // size if self.drop_last else math.ceil(self.size / size)

    def minibatches(self, generator: torch.Generator | None = None) -> Iterator[tuple[int, Tensor]]:
        """``(epoch, item indices)`` of every optimizer step, in order."""
        size = min(self.minibatch_size, self.size)
        for epoch in range(self.epochs):
            order = torch.randperm(self.size, generator=generator) if self.shuffle else torch.arange(self.size)
            for start in range(0, self.minibatches_per_epoch * size, size):
                yield epoch, order[start : start + size]


# ---------------------------------------------------------------------- the core loss of one micro-batch


@dataclass(frozen=True)
class CoreLossSpec:
    """Which core policy loss a family trains with, and its KL and entropy terms.

    Attributes:
        name: a registered core policy loss (``mmpo.core.POLICY_LOSSES``).
        settings: its keyword settings (clip bounds, GSPO / CISPO options, ...).
        kl_kind: KL estimator to the reference (``mmpo.core.KL_KINDS``).
        beta: KL coefficient (without a reference the part is logged as 0 with coefficient 0).
        entropy_coef: entropy bonus coefficient (the part is -entropy_coef x entropy).
    """

    name: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    kl_kind: str = "k3"
    beta: float = 0.0
    entropy_coef: float = 0.0


@dataclass
class ScoredMicroBatch:
    """What a family's scoring hands the engine for one micro-batch: all ``(N, T)`` unless noted.

    ``log_probs`` carry the gradient; ``entropy`` is None when not computed; ``token_weights`` are
    per-token loss weights (rollout IS correction); ``loss_entropy`` is the detached entropy for a loss
    that reads it (HAPO)."""

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_log_probs: Tensor | None = None
    entropy: Tensor | None = None
    token_weights: Tensor | None = None
    loss_entropy: Tensor | None = None


def core_loss_parts(
    scored: ScoredMicroBatch, spec: CoreLossSpec, aggregation: Aggregation
) -> tuple[LossParts, dict[str, Any]]:
    """The named parts ``policy``, ``kl`` and (when the entropy was computed) ``entropy`` of one
    micro-batch, normalised by ``aggregation`` (its global counts when set), and the core's metrics."""
    extra_inputs = {} if scored.loss_entropy is None else {"entropy": scored.loss_entropy}
    pg_loss, metrics = policy_loss(
        spec.name, scored.log_probs, scored.old_log_probs, scored.advantages, scored.mask, agg=aggregation.mode,
        token_weights=scored.token_weights, global_tokens=aggregation.global_tokens,
        global_seqs=aggregation.global_seqs, norm_len=aggregation.norm_len, **dict(spec.settings), **extra_inputs,
    )
    parts = LossParts().add("policy", pg_loss)
    mask = scored.mask.to(scored.log_probs.dtype)
    if scored.ref_log_probs is not None:
        kl = aggregation(kl_penalty(scored.log_probs, scored.ref_log_probs.detach(), spec.kl_kind), mask)
        parts.add("kl", kl, spec.beta)
    else:  # logged as 0 with coefficient 0: never summed, one metric vocabulary with or without a reference
        parts.add("kl", torch.zeros((), device=scored.log_probs.device), 0.0)
    if scored.entropy is not None:
        parts.add("entropy", aggregation(scored.entropy, mask), -spec.entropy_coef)
    return parts, dict(metrics)


def total_loss(parts: LossParts, extra: LossParts) -> tuple[Tensor, LossParts]:
    """The one place a policy loss is summed: the engine's parts, then the algorithm's own; returns the
    total and every part by name (a clash of names is refused)."""
    named = LossParts().update_from(parts).update_from(extra)
    loss = parts.total() + extra.total() if len(extra) else parts.total()
    return loss, named


# ---------------------------------------------------------------------- the metrics of one micro-batch

# extremes do not sum over micro-batches (min / max, not means): logged only when a step has one micro-batch
NON_ADDITIVE_METRICS = frozenset({"policy/ratio_min", "policy/ratio_max", "rollout_is/min", "rollout_is/max",
                                  "rollout_is/logp_diff_max"})


def micro_batch_metrics(
    named: LossParts,
    total: Tensor | float,
    core_metrics: Mapping[str, Any] | None = None,
    *,
    weight: float = 1.0,
    extra: LossParts | None = None,
    single_micro_batch: bool = False,
) -> dict[str, float]:
    """The ``losses/*`` and ``policy/*`` metrics of one micro-batch, in every family's one vocabulary.

    The engine sums the dicts of a step's micro-batches (:meth:`UpdateEngine.optimizer_step`), so:

    * ``losses/<name>`` (each unweighted part of ``named``), ``losses/total`` (``total``) and, when ``extra``
      is given, ``losses/extra`` (the algorithm's own parts, weighted; 0.0 when it has none): the
      micro-batch's losses are shares of the step's global value (normalised by the global counts), so
      their sum is the step's value;
    * ``core_metrics`` (the core loss's ``policy/*`` and the rollout correction's ``rollout_is/*``) are
      means over this micro-batch: each is multiplied by ``weight``, the micro-batch's share of the step's
      loss tokens (1.0 for a step of one micro-batch), so the sum is the step's token-weighted mean.
      Extremes (:data:`NON_ADDITIVE_METRICS`) do not sum: kept only with ``single_micro_batch``.
    """
    metrics = {key: float(value) for key, value in named.metrics().items()}
    if extra is not None and "losses/extra" not in metrics:
        metrics["losses/extra"] = float(extra.total().detach()) if len(extra) else 0.0
    metrics["losses/total"] = float(total.detach()) if isinstance(total, Tensor) else float(total)
    for key, value in (core_metrics or {}).items():
        if key in NON_ADDITIVE_METRICS and not single_micro_batch:
            continue
        metrics[key] = metrics.get(key, 0.0) + float(value) * weight
    return metrics


# ---------------------------------------------------------------------- one optimizer step


@dataclass
class MicroLoss:
    """One micro-batch's loss (already normalised; the engine scales it by ``loss_scale``) and the
    metrics it adds to the step's sums (already weighted by the caller)."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StepResult:
    """One optimizer step: the summed metrics (with ``policy/grad_norm``), the loss summed over
    micro-batches, whether the update was applied (False: the non-finite guard skipped it) and the last
    micro-batch's loss tensor (for callers that return it to Lightning)."""

    metrics: dict[str, float]
    loss: float
    applied: bool
    last_loss: Tensor | None = None


class UpdateEngine:
    """Optimizer steps for a Lightning module in manual optimisation.

    Args:
        module: the LightningModule (``manual_backward``, ``optimizers()``, ``lr_schedulers()``, and the
            non-finite guard's ``nonfinite_step_ok``).
        max_grad_norm: clip each parameter group's gradient norm to this; None or 0 = no clipping (the norm
            is still measured and logged).
        clip_groups: the parameter groups clipped separately (DPPO clips its actor and its critic each to
            ``max_grad_norm``); default one group, the module's trainable parameters.
    """

    def __init__(
        self,
        module: Any,
        *,
        max_grad_norm: float | None,
        clip_groups: Callable[[], Sequence[Iterable[torch.nn.Parameter]]] | None = None,
    ) -> None:
        self.module = module
        self.max_grad_norm = max_grad_norm
        self._clip_groups = clip_groups

    @property
    def world_size(self) -> int:
        """Data-parallel processes (1 outside a Trainer)."""
        trainer = getattr(self.module, "_trainer", None)
        return 1 if trainer is None else trainer.world_size

    def sum_over_ranks(self, value: Tensor) -> Tensor:
        """``value`` summed over every data-parallel rank (itself in one process)."""
        if self.world_size == 1:
            return value
        return self.module.trainer.strategy.reduce(value.clone(), reduce_op="sum")

    def global_normalisers(self, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, sequences) of a minibatch's ``(N, T)`` loss mask summed over every rank: the normalisers
        that make a loss split over micro-batches and ranks (each backpropagated x the world size) equal to the
        one big batch's; every rank gets the same values."""
        tokens = self.sum_over_ranks(mask.sum().to(torch.float32))
        sequences = self.sum_over_ranks((mask.sum(-1) > 0).sum().to(torch.float32))
        return tokens, sequences

    def _groups(self) -> list[list[torch.nn.Parameter]]:
        if self._clip_groups is not None:
            return [list(group) for group in self._clip_groups()]
        return [[p for p in self.module.parameters() if p.requires_grad]]

    def optimizers(self) -> list[Any]:
        optimizers = self.module.optimizers()
        return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def _step_schedulers(self) -> None:
        if getattr(self.module, "_trainer", None) is None:  # outside a Trainer (unit tests): no schedulers
            return
        schedulers = self.module.lr_schedulers()
        if schedulers is None:
            return
        for scheduler in schedulers if isinstance(schedulers, (list, tuple)) else [schedulers]:
            scheduler.step()  # per optimizer step, like trainer.max_steps and warmup_steps

    def clip_and_measure(self) -> Tensor:
        """Clip every group's gradient norm (when ``max_grad_norm``) and return the total norm before
        clipping, over every rank's shard under FSDP2."""
        from mmpo.vlm.fsdp import full_value

        norms = []
        for params in self._groups():
            if self.max_grad_norm:
                norms.append(full_value(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)))
            else:
                grads = [p.grad for p in params if p.grad is not None]
                norms.append(full_value(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros(()))
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms]))

    def optimizer_step(
        self,
        micro_batches: Iterable[MicroBatch],
        micro_loss: Callable[[MicroBatch], MicroLoss],
        *,
        loss_scale: float = 1.0,
        stepped: Sequence[Any] | None = None,
    ) -> StepResult:
        """One optimizer step accumulated over ``micro_batches``.

        ``micro_loss`` scores one micro-batch and returns its loss; the engine backpropagates
        ``loss x loss_scale``. ``stepped``: the optimizers to step (default all; DPPO's actor sits out its
        critic warm-up), every optimizer's gradients are zeroed and guarded."""
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_sum = 0.0
        last = None
        for micro in micro_batches:
            out = micro_loss(micro)
            self.module.manual_backward(out.loss * loss_scale if loss_scale != 1.0 else out.loss)
            loss_sum += float(out.loss.detach())
            last = out.loss
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        grad_norm = self.clip_and_measure()
        sums["policy/grad_norm"] = float(grad_norm)
        # a non-finite loss or gradient norm drops the gradients: the steps below then change nothing
        applied = self.module.nonfinite_step_ok(loss_sum, grad_norm, *optimizers)
        for optimizer in optimizers if stepped is None else stepped:
            optimizer.step()
        self._step_schedulers()
        return StepResult(sums, loss_sum, applied, last)

    def empty_step(self) -> None:
        """Count an optimizer step that has no loss (every item of the minibatch was filtered out): no
        parameter has a gradient, so nothing changes, but ``global_step`` and the schedule advance and a run
        bounded by ``max_steps`` still ends."""
        for optimizer in self.optimizers():
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()
        self._step_schedulers()

    def run_pass(
        self,
        schedule: UpdateSchedule,
        step: Callable[[int, Tensor], dict[str, float] | None],
        *,
        generator: torch.Generator | None = None,
        stop: Callable[[dict[str, float]], bool] | None = None,
    ) -> list[dict[str, float]]:
        """One update pass: ``step(epoch, indices)`` per minibatch (it calls :meth:`optimizer_step`),
        stopping early when ``stop(metrics)`` says so (DPPO's target KL); returns each step's metrics."""
        history: list[dict[str, float]] = []
        for epoch, index in schedule.minibatches(generator):
            metrics = step(epoch, index)
            if metrics:
                history.append(metrics)
            if stop is not None and metrics and stop(metrics):
                break
        return history


# ---------------------------------------------------------------------- update-level variants


class UpdateWrapper:
    """A variant that changes how a whole update pass runs, for every family (SFPO's slow-fast update).

    A family's module calls :meth:`wrap` with its plain pass (a no-argument callable returning the pass's
    per-step metrics), the parameters that move and the pass-level context; the default runs it as is."""

    def wrap(self, plain: Callable[[], list[dict[str, float]]], parameters: Callable[[], Iterable[Tensor]],
             context: "PassContext") -> list[dict[str, float]]:
        return plain()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


def mean_logged_entropy(stats: list[dict[str, float]]) -> float | None:
    """The mean of the ``entropy`` metric over a pass's optimizer steps (None when none logged it)."""
    entropies = [s["entropy"] for s in stats if "entropy" in s]
    return sum(entropies) / len(entropies) if entropies else None


@dataclass
class PassContext:
    """What an update wrapper may read about the pass it wraps: ``mean_entropy`` (the rollout policy's
    mean entropy over the loss tokens, None when unknown), ``trains_actor`` (False during a critic warm-up)
    and ``ensure_old_log_probs`` (a callable that makes pi_old fixed for the pass when it would otherwise be
    taken on-policy from the moving weights)."""

    mean_entropy: Callable[[list[dict[str, float]]], float | None] = lambda stats: None
    trains_actor: bool = True
    ensure_old_log_probs: Callable[[], None] = lambda: None
