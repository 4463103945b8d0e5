"""Named benchmarks read from local copies of the publishers' files (``mmpo eval --data-dir DIR``).

Importing this package registers every benchmark below with :mod:`mmpo.eval.registry`; ``mmpo eval
--list`` shows each one's expected files. One module per benchmark or family; answer extraction and
scoring rules are shared in :mod:`mmpo.eval.benchmarks.scoring`.
"""

from __future__ import annotations

from mmpo.eval.benchmarks import chartqa, geometry, mathverse, mathvision, mathvista, mmmu, text
from mmpo.eval.benchmarks.base import LocalBenchmark, decode_row_images
from mmpo.eval.benchmarks.files import BenchmarkFilesError
from mmpo.eval.benchmarks.scoring import judge

LOCAL_BENCHMARKS: list[LocalBenchmark] = [
    mathvista.BENCHMARK, *mathverse.BENCHMARKS, mathvision.BENCHMARK, *geometry.BENCHMARKS, chartqa.BENCHMARK,
    mmmu.BENCHMARK, *text.BENCHMARKS,
]


def register_local_benchmarks() -> None:
    """Register every local-file benchmark with the eval registry (idempotent)."""
    from mmpo.eval.registry import register_local_benchmark

    for benchmark in LOCAL_BENCHMARKS:
        register_local_benchmark(benchmark, overwrite=True)


register_local_benchmarks()

__all__ = ["LOCAL_BENCHMARKS", "LocalBenchmark", "BenchmarkFilesError", "decode_row_images", "judge",
           "register_local_benchmarks"]
