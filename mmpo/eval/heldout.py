"""Held-out accuracy of a VLM: the one scoring the bench scripts use on test-split items.

A thin layer over :func:`mmpo.eval.harness.evaluate` (the ``mmpo eval`` path: ``HFGenerateEngine`` greedy
decoding, the shared math-verify ``accuracy`` reward, correct when the score is > 0.5), reduced to the
numbers a bench table prints: accuracy per task and over all items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mmpo.eval.harness import DEFAULT_MAX_NEW_TOKENS, evaluate
from mmpo.eval.registry import Row

ALL = "all"
"""The key of the accuracy over every item (tasks weighted by their item counts)."""


def heldout_accuracy(model: Any, processor: Any, rows: Sequence[Row], *, system_prompt: str | None = "default",
                     max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = 16) -> dict[str, float]:
    """Greedy accuracy of a loaded VLM on held-out ``rows``: ``{task: accuracy, ..., "all": accuracy}``.

    Args:
        model, processor: from ``mmpo.vlm.factory.load_vlm`` (or a training module's).
        rows: contract rows (``images``, ``problem``, ``answer``, ``task``); tasks keep their first-seen order.
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT``; ``None``: no system prompt.
        batch_size: prompts per ``generate`` call.
    """
    results = evaluate(model, processor, rows, num_samples=1, greedy=True, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, system_prompt=system_prompt, progress=False)
    accuracy = {task: float(metrics["accuracy"]) for task, metrics in results["by_task"].items()}
    accuracy[ALL] = float(results["accuracy"])
    return accuracy


def checkpoint_heldout_accuracy(model_path: str | Path, rows: Sequence[Row], **options: Any) -> dict[str, float]:
    """:func:`heldout_accuracy` of a saved HF checkpoint (``load_vlm(model_path)``); ``options`` as there."""
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(model_path)
    return heldout_accuracy(model, processor, rows, **options)
