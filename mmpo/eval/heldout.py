"""Held-out accuracy of a VLM: the one scoring the bench scripts use on test-split items.

A thin layer over :func:`mmpo.eval.harness.evaluate` (the ``mmpo eval`` path: ``HFGenerateEngine`` greedy
decoding, the shared math-verify ``accuracy`` reward, correct when the score is > 0.5), reduced to the
numbers a bench table prints: accuracy per task and over all items; :func:`heldout_texts` and
:func:`sampled_accuracy` give the completions (greedy or sampled on a fixed seed) and avg@k per item.
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


def heldout_texts(model: Any, processor: Any, rows: Sequence[Row], *, system_prompt: str | None = "default",
                  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, samples: int = 0, temperature: float = 1.0,
                  seed: int = 1234) -> list[str]:
    """Completions of a loaded VLM for held-out ``rows``: one greedy completion per row, or with ``samples`` > 0
    that many sampled ones per row (contiguous per row) at ``temperature``.

    Sampling draws from torch's global generator seeded with ``seed`` inside a forked RNG state, so every model
    is scored on the same seed's draws and the caller's RNG stream is left as it was; the model's train/eval
    mode is restored. Batches: 16 prompts greedy, 64 completions sampled."""
    import torch

    from mmpo.vlm.rollout import HFGenerateEngine

    rows = list(rows)
    engine = HFGenerateEngine(model, processor, system_prompt=system_prompt)
    texts: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            batch = 16 if samples <= 0 else max(1, 64 // samples)
            for start in range(0, len(rows), batch):
                texts += engine.generate(rows[start:start + batch], num_samples=max(1, samples),
                                         max_new_tokens=max_new_tokens, do_sample=samples > 0,
                                         temperature=temperature).texts
    finally:
        model.train(was_training)
    return texts


def sampled_accuracy(model: Any, processor: Any, rows: Sequence[Row], *, samples: int, temperature: float,
                     system_prompt: str | None = "default", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                     seed: int = 1234) -> list[float]:
    """Per row, the fraction of ``samples`` completions sampled at ``temperature`` that the shared ``accuracy``
    reward scores correct (> 0.5): avg@k, the pass@1 estimate at the RL sampling temperature (what RL
    optimises; less jumpy than the greedy answer). Draws as in :func:`heldout_texts`."""
    from mmpo.rewards import accuracy_reward

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rows = list(rows)
    texts = heldout_texts(model, processor, rows, system_prompt=system_prompt, max_new_tokens=max_new_tokens,
                          samples=samples, temperature=temperature, seed=seed)
    correct = [float(score > 0.5) for score in accuracy_reward(texts, [row for row in rows for _ in range(samples)]).tolist()]
    return [sum(correct[k * samples:(k + 1) * samples]) / samples for k in range(len(rows))]
