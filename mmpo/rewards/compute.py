"""Weighted sum of reward functions, each run with a deadline that really stops it.

With a deadline (``timeout_s``), reward functions run in the reward worker process
(``mmpo.rewards.worker``): a call that misses it kills the worker, and the next call gets a
fresh one. A function that raises, hangs, or returns a malformed tensor contributes zeros for
that call, logs a warning (completion text shortened) and increments ``rewards/<name>/errors``
(and ``rewards/<name>/timeouts`` for a missed deadline): a bad reward never kills or hangs a
long run.

Extreme values (one rule, before any advantage is computed; docs/reliability.md, "Extreme rewards"):

- a non-finite value (NaN, +-inf) is rejected: that completion gets no reward from that function,
  as if it returned None ("not applicable"), and ``rewards/<name>/nonfinite`` counts them (a warning
  names the function);
- a finite value beyond ``REWARD_BOUND`` (|r| > 1e6, e.g. 3e38, whose group mean would overflow
  float32 to NaN) is clamped to +-1e6 and counted in ``rewards/<name>/clamped``;
- the weighted total is clamped to +-1e6 too, counted in ``rewards/total/clamped``.

So the step always trains on finite, bounded rewards: never a NaN advantage and a silently skipped step.

The worker imports no torch for the built-ins: it runs their torch-free ``worker_form``
(``mmpo.rewards.registry``), which returns a list of floats, and this process turns every result
into a tensor. A reward whose module imports torch (a user's, ``mmpo.rewards.step``'s) makes the
worker import it then, once.

Which functions run in the worker: those it can load by reference, i.e. defined at module level
(or a ``functools.partial`` of such a function) in a module the worker can import; the built-ins
and any ``@register_reward`` function in your own module qualify, and so do user functions given
as ``path/to/file.py:fn`` or ``package.module:fn`` (``mmpo.rewards.user``: the worker loads the
file by path itself). Others (a lambda, a closure,
a function of ``__main__``) run in this process on a daemon thread, as a warning says once per
reward: that deadline only stops the waiting, not the function; while a timed-out call still
runs, later calls of the same reward fail at once instead of piling up stuck threads.
``timeout_s=None`` runs every function inline, without a deadline.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mmpo.rewards.log_text import shorten
from mmpo.rewards.models import is_model_reward, reward_call_metrics
from mmpo.rewards.registry import RewardFn, worker_form_of
from mmpo.rewards.user import is_user_reward_spec, resolve_reward, reward_label
from mmpo.rewards.worker import CallOutcome, WorkerUnavailable, get_reward_worker

logger = logging.getLogger(__name__)

DEFAULT_REWARD_WEIGHTS: dict[str, float] = {"accuracy": 0.9, "format": 0.1}
"""0.9 x accuracy + 0.1 x format (PAPO / EasyR1, arXiv 2507.06448)."""

REWARD_BOUND = 1e6
"""Largest |reward| a function value or the weighted total may have; larger finite values are clamped
(a group of 8 at 1e6 sums to 8e6, far inside float32, so group means and stds stay finite)."""


class RewardCallError(RuntimeError):
    """A reward function raised, timed out, or returned a malformed tensor."""


_HUNG_THREADS: dict[str, threading.Thread] = {}
"""Per reward name, the thread of an in-process call that timed out and may still be running."""

_RUNS_IN_CALLER: dict[str, RewardFn] = {}
"""Rewards the worker cannot load, by name (the function object, so a re-registered name is retried)."""


def _call_in_thread(name: str, fn: RewardFn, completions: list[str], rows: list[dict[str, Any]],
                    timeout_s: float) -> CallOutcome:
    stuck = _HUNG_THREADS.get(name)
    if stuck is not None:
        if stuck.is_alive():
            # Do not pile up a new stuck thread on every step while the old one still runs.
            return CallOutcome(error="is still running from an earlier call that timed out", timed_out=True)
        del _HUNG_THREADS[name]
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(completions, rows)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _HUNG_THREADS[name] = thread
        return CallOutcome(error=f"did not finish within {timeout_s} s", timed_out=True)
    if "error" in result:
        exc = result["error"]
        return CallOutcome(error=f"raised {type(exc).__name__}: {exc}")
    return CallOutcome(value=result["value"])


def _run_inline(fn: RewardFn, completions: list[str], rows: list[dict[str, Any]]) -> CallOutcome:
    try:
        return CallOutcome(value=fn(completions, rows))
    except Exception as exc:  # noqa: BLE001 - any failure of a user reward becomes zeros
        return CallOutcome(error=f"raised {type(exc).__name__}: {exc}")


def _run_rewards(fns: dict[str, RewardFn], completions: list[str], rows: list[dict[str, Any]],
                 timeout_s: float | None) -> dict[str, CallOutcome]:
    """name -> outcome of ``fn(completions, rows)``, in the worker where possible (module docstring)."""
    if timeout_s is None:
        return {name: _run_inline(fn, completions, rows) for name, fn in fns.items()}
    # model rewards (mmpo.rewards.models) stay resident here: the worker would load its own copy
    # a built-in goes as its torch-free worker_form (a list of floats back), so the worker needs no torch
    for_worker = [(name, worker_form_of(fn)) for name, fn in fns.items()
                  if _RUNS_IN_CALLER.get(name) is not fn and not getattr(fn, "runs_in_process", False)]
    outcomes: dict[str, CallOutcome] = {}
    if for_worker:
        try:
            outcomes = get_reward_worker().run(for_worker, (completions, rows), timeout_s)
        except WorkerUnavailable as exc:
            logger.warning("rewards run in this process this time, where a deadline cannot stop them: %s",
                           shorten(str(exc)))
    for name, fn in fns.items():
        outcome = outcomes.get(name)
        if outcome is not None and not outcome.unloadable:
            continue
        if outcome is not None:
            _RUNS_IN_CALLER[name] = fn
            logger.warning(
                "reward %r runs in the training process, where its deadline cannot stop a hang (%s); "
                "define it at module level in an importable module to run it in the reward worker",
                name, shorten(outcome.error or ""))
        outcomes[name] = _call_in_thread(name, fn, completions, rows, timeout_s)
    return outcomes


def _as_reward_vector(name: str, value: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(values (N,) float32 with NaN where not applicable, applicable (N,) bool, rejected, clamped) from a
    reward's result: a tensor, or a list of numbers and None (None = not applicable; user rewards,
    ``mmpo.rewards.user``). Non-finite values are rejected (not applicable, counted in ``rejected``);
    finite ones beyond ``REWARD_BOUND`` are clamped to it (counted in ``clamped``). Read in float64, so
    a Python float too large for float32 (1e39) is clamped, not turned into inf."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to(torch.float64).reshape(-1).cpu()
        applicable = torch.ones(tensor.shape, dtype=torch.bool)
    else:
        items = list(value)
        applicable = torch.tensor([item is not None for item in items], dtype=torch.bool)
        tensor = torch.as_tensor([float("nan") if item is None else item for item in items],
                                 dtype=torch.float64).reshape(-1)
    if tensor.numel() != n:
        raise RewardCallError(f"reward {name!r} returned {tensor.numel()} values for {n} completions")
    nonfinite = applicable & ~torch.isfinite(tensor)
    beyond = applicable & torch.isfinite(tensor) & (tensor.abs() > REWARD_BOUND)
    applicable = applicable & ~nonfinite
    tensor = torch.where(nonfinite, torch.nan, tensor.clamp(-REWARD_BOUND, REWARD_BOUND))
    return tensor.to(torch.float32), applicable, int(nonfinite.sum()), int(beyond.sum())


def compute_rewards(
    names_and_weights: dict[str, float] | None,
    completions: list[str],
    rows: list[dict[str, Any]],
    *,
    timeout_s: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Weighted sum of reward functions: registered names and user specs (``file.py:fn``, ``module:fn``).

    ``total[i] = sum of weight_f * r_f[i]`` over the functions f whose ``r_f[i]`` is not None: a
    user function's None ("not applicable") is skipped for that completion, like TRL's nansum over
    functions; a completion that every function skips gets 0 (a warning says how many).

    Args:
        names_and_weights: reward name or user spec -> weight; None means ``DEFAULT_REWARD_WEIGHTS``.
        completions: N completion texts.
        rows: N Rows (``rows[i]`` belongs to ``completions[i]``).
        timeout_s: deadline per function call in seconds (the function runs in the reward worker
            process, killed when it is missed); None runs inline without one.

    Returns:
        total: (N,) float32, the weighted sum above.
        per_fn: name -> (N,) float32 unweighted rewards (NaN where a user function returned None;
        zeros for a failed call).
        metrics: ``rewards/<label>/mean`` (over the completions the function applies to; NaN if
        none), ``rewards/<label>/errors`` and ``rewards/<label>/timeouts`` (0 or 1 per call),
        ``rewards/<label>/nonfinite`` and ``rewards/<label>/clamped`` (values rejected / clamped by the
        extreme-value rule of the module docstring), ``rewards/total/clamped``, for
        user functions ``rewards/<label>/none_frac`` (share of None), ``rewards/total/mean`` and
        ``perf/reward_worker_restarts`` (reward workers killed or found dead so far in this
        process). ``<label>`` is the registered name or the user function's own name.

    Raises:
        ValueError: an unknown name or unusable spec (before any function runs).
    """
    weights = DEFAULT_REWARD_WEIGHTS if names_and_weights is None else names_and_weights
    if len(completions) != len(rows):
        raise ValueError(f"got {len(completions)} completions but {len(rows)} rows; pass one row per completion")
    n = len(completions)
    fns = {name: resolve_reward(name) for name in weights}  # unknown names fail before any work
    outcomes = _run_rewards(fns, completions, rows, timeout_s)
    total = torch.zeros(n, dtype=torch.float32)
    scored = torch.zeros(n, dtype=torch.bool)
    per_fn: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    for name, weight in weights.items():
        outcome = outcomes[name]
        errors = rejected = clamped = 0
        try:
            if outcome.error is not None:
                raise RewardCallError(f"reward {name!r} {outcome.error}")
            values, applicable, rejected, clamped = _as_reward_vector(name, outcome.value, n)
        except Exception as exc:  # noqa: BLE001 - any failure of a user reward becomes zeros
            logger.warning("reward %r failed, using zeros for this batch: %s", name, shorten(str(exc)))
            values, applicable = torch.zeros(n, dtype=torch.float32), torch.ones(n, dtype=torch.bool)
            errors = 1
        if rejected:
            logger.warning("reward %r returned %d non-finite value(s) of %d: rejected (those completions get "
                           "no reward from it)", name, rejected, n)
        if clamped:
            logger.warning("reward %r returned %d value(s) beyond +-%g: clamped to it", name, clamped, REWARD_BOUND)
        per_fn[name] = values
        total += torch.where(applicable, float(weight) * values, 0.0)
        scored |= applicable
        label = reward_label(name)
        if n == 0:
            metrics[f"rewards/{label}/mean"] = 0.0
        else:
            metrics[f"rewards/{label}/mean"] = float(values[applicable].mean()) if applicable.any() else float("nan")
        metrics[f"rewards/{label}/errors"] = float(errors)
        metrics[f"rewards/{label}/timeouts"] = float(outcome.timed_out)
        metrics[f"rewards/{label}/nonfinite"] = float(rejected)
        metrics[f"rewards/{label}/clamped"] = float(clamped)
        if is_user_reward_spec(name) or is_model_reward(name):
            metrics[f"rewards/{label}/none_frac"] = float((~applicable).float().mean()) if n else 0.0
        if outcome.error is None:  # a judge's unparseable / failed judgements of this call
            for key, value in reward_call_metrics(fns[name]).items():
                metrics[f"rewards/{label}/{key}"] = value
    if n and not scored.all():
        logger.warning("%d of %d completions got None from every reward function; their total reward is 0",
                       int((~scored).sum()), n)
    # bounded values with finite weights: the total can exceed the bound (weights > 1) but not float32
    total_beyond = total.abs() > REWARD_BOUND
    metrics["rewards/total/clamped"] = float(total_beyond.sum())
    total = total.clamp(-REWARD_BOUND, REWARD_BOUND)
    metrics["rewards/total/mean"] = float(total.mean()) if n else 0.0
    metrics["perf/reward_worker_restarts"] = float(get_reward_worker().restarts)
    return total, per_fn, metrics
