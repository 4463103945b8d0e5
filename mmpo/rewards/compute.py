"""Weighted sum of reward functions, each run with a deadline.

Each function runs in its own daemon thread; the caller waits at most
``timeout_s`` seconds. A function that raises, hangs, or returns a malformed
tensor contributes zeros for that call, logs a warning and increments
``rewards/<name>/errors``: a bad reward never kills a long run. A hung thread
cannot be killed in Python; it is left to finish in the background (daemon, so
it never blocks interpreter exit), and while it runs, further calls of the same
reward fail at once (zeros, counted) instead of starting more stuck threads.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mmpo.rewards.registry import get_reward

logger = logging.getLogger(__name__)

DEFAULT_REWARD_WEIGHTS: dict[str, float] = {"accuracy": 0.9, "format": 0.1}
"""0.9 x accuracy + 0.1 x format (PAPO / EasyR1 default, arXiv 2507.06448)."""


class RewardCallError(RuntimeError):
    """A reward function raised, timed out, or returned a malformed tensor."""


_HUNG_WORKERS: dict[str, threading.Thread] = {}
"""Per reward name, the worker thread of a call that timed out and may still be running."""


def _call_with_deadline(name: str, fn, completions: list[str], rows: list[dict[str, Any]],
                        timeout_s: float | None) -> torch.Tensor:
    if timeout_s is None:
        return fn(completions, rows)
    stuck = _HUNG_WORKERS.get(name)
    if stuck is not None:
        if stuck.is_alive():
            # Do not pile up a new stuck thread on every step while the old one still runs.
            raise RewardCallError(f"reward {name!r} is still running from an earlier call that timed out")
        del _HUNG_WORKERS[name]
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(completions, rows)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            result["error"] = exc

    worker = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        _HUNG_WORKERS[name] = worker
        raise RewardCallError(f"reward {name!r} did not finish within {timeout_s} s")
    if "error" in result:
        exc = result["error"]
        raise RewardCallError(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
    return result["value"]


def _as_reward_vector(name: str, value: Any, n: int) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=torch.float32).reshape(-1) if not isinstance(value, torch.Tensor) \
        else value.detach().to(torch.float32).reshape(-1).cpu()
    if tensor.numel() != n:
        raise RewardCallError(f"reward {name!r} returned {tensor.numel()} values for {n} completions")
    if not torch.isfinite(tensor).all():
        raise RewardCallError(f"reward {name!r} returned non-finite values")
    return tensor


def compute_rewards(
    names_and_weights: dict[str, float] | None,
    completions: list[str],
    rows: list[dict[str, Any]],
    *,
    timeout_s: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Weighted sum of registered rewards.

    Args:
        names_and_weights: reward name -> weight; None means ``DEFAULT_REWARD_WEIGHTS``.
        completions: N completion texts.
        rows: N Rows (``rows[i]`` belongs to ``completions[i]``).
        timeout_s: deadline per function call in seconds; None runs inline without one.

    Returns:
        total: (N,) float32, sum of weight x reward.
        per_fn: name -> (N,) float32 unweighted rewards (zeros for a failed call).
        metrics: ``rewards/<name>/mean``, ``rewards/<name>/errors`` (0 or 1 per call)
        and ``rewards/total/mean``.
    """
    weights = DEFAULT_REWARD_WEIGHTS if names_and_weights is None else names_and_weights
    if len(completions) != len(rows):
        raise ValueError(f"got {len(completions)} completions but {len(rows)} rows; pass one row per completion")
    n = len(completions)
    fns = {name: get_reward(name) for name in weights}  # unknown names fail before any work
    total = torch.zeros(n, dtype=torch.float32)
    per_fn: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    for name, weight in weights.items():
        errors = 0
        try:
            values = _as_reward_vector(name, _call_with_deadline(name, fns[name], completions, rows, timeout_s), n)
        except Exception as exc:  # noqa: BLE001 - any failure of a user reward becomes zeros
            logger.warning("reward %r failed, using zeros for this batch: %s", name, exc)
            values = torch.zeros(n, dtype=torch.float32)
            errors = 1
        per_fn[name] = values
        total += float(weight) * values
        metrics[f"rewards/{name}/mean"] = float(values.mean()) if n else 0.0
        metrics[f"rewards/{name}/errors"] = float(errors)
    metrics["rewards/total/mean"] = float(total.mean()) if n else 0.0
    return total, per_fn, metrics
