"""Multimodal eval harness: benchmark registry, accuracy / avg@k / pass@k, reports and plots.

``mmpo eval`` (``mmpo.eval.cli``) evaluates a checkpoint on named benchmarks;
``evaluate`` / ``evaluate_checkpoint`` (``mmpo.eval.harness``) are the Python API.
"""

from mmpo.eval.metrics import pass_at_k, summarize_correctness
from mmpo.eval.registry import (
    BENCHMARKS, Benchmark, UnknownBenchmarkError, register_benchmark, register_local_benchmark, resolve_benchmark,
)

__all__ = [
    "BENCHMARKS", "Benchmark", "UnknownBenchmarkError", "register_benchmark", "register_local_benchmark",
    "resolve_benchmark",
    "pass_at_k", "summarize_correctness", "evaluate", "evaluate_checkpoint",
]


def __getattr__(name: str):
    # The harness imports torch and the generation engine; load it only when asked for.
    if name in ("evaluate", "evaluate_checkpoint"):
        from mmpo.eval import harness

        return getattr(harness, name)
    raise AttributeError(f"module 'mmpo.eval' has no attribute {name!r}")
