"""Accuracy metrics over k sampled answers per item: avg@k and pass@k.

pass@k uses the unbiased estimator of Chen et al., "Evaluating Large Language
Models Trained on Code" (arXiv 2107.03374, section 2.1): with n samples of which
c are correct, pass@k = 1 - C(n - c, k) / C(n, k), computed as a running
product so that large n does not overflow. avg@k is the mean correctness over the
k samples (the usual "mean@k"), an unbiased estimate of pass@1.

Written by hand because no installed dependency ships the estimator (it is a
few lines of numpy in the paper; HF `evaluate`'s code_eval metric is the same).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one item (arXiv 2107.03374, eq. 1).

    Args:
        num_samples: n, the number of answers sampled for the item.
        num_correct: c, how many of them were correct (0 <= c <= n).
        k: the budget, 1 <= k <= n.

    Returns:
        1 - C(n-c, k) / C(n, k), the probability that at least one of k answers
        drawn without replacement from the n is correct.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def pass_at_k_budgets(num_samples: int) -> list[int]:
    """The k values reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    budgets, k = [], 1
    while k < num_samples:
        budgets.append(k)
        k *= 2
    budgets.append(num_samples)
    return budgets


def summarize_correctness(correct: Sequence[Sequence[bool]] | np.ndarray) -> dict[str, float]:
    """Benchmark metrics from a correctness matrix.

    Args:
        correct: (num_items, num_samples) booleans; row i holds item i's samples.

    Returns:
        ``accuracy`` (mean over items and samples; equals greedy accuracy when
        num_samples is 1), ``avg@n`` (the same number under its usual name), and
        ``pass@k`` for each k in :func:`pass_at_k_budgets`, each averaged over items.
         ``num_items`` and ``num_samples`` are included as ints.
    """
    matrix = np.asarray(correct, dtype=bool)
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"correct must be a non-empty (num_items, num_samples) matrix, got shape {matrix.shape}")
    num_items, num_samples = matrix.shape
    accuracy = float(matrix.mean())
    metrics: dict[str, float] = {
        "num_items": num_items,
        "num_samples": num_samples,
        "accuracy": accuracy,
        f"avg@{num_samples}": accuracy,
    }
    num_correct = matrix.sum(axis=1)
    for k in pass_at_k_budgets(num_samples):
        metrics[f"pass@{k}"] = float(np.mean([pass_at_k(num_samples, int(c), k) for c in num_correct]))
    return metrics
