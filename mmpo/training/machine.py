"""What decides the last bits of a one-thread CPU run besides the code, and how to pin it.

The SIMD level torch, MKL and oneDNN dispatch to (AVX2 and AVX-512 kernels round differently) changes long
CPU runs: on 2026-12-01 the same 500-step dLLM SFT gave different weights with the machine's AVX-512 default
and with the AVX2 pins below. With the pins, an Intel AVX-512 machine reproduced exactly the dLLM SFT
accuracy (0.199) recorded on 2026-11-29 on an AMD EPYC machine, where the default had given 0.164.
So recorded "exact" results are made with ``PORTABLE_CPU_NUMERICS`` set (before torch is imported).
"""

from __future__ import annotations

from pathlib import Path

# One thread (parallel reductions change the order of sums) and the AVX2 code paths of ATen, MKL (its
# conditional-numerical-reproducibility branch) and oneDNN: every x86 machine of the last decade has them.
# They are read when the libraries initialise: set them in the environment of a fresh process.
PORTABLE_CPU_NUMERICS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
                         "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_fingerprint() -> dict[str, str]:
    """{"cpu": model name, "isa": torch's CPU capability, "torch": version}."""
    import torch  # here, not at the top: importing PORTABLE_CPU_NUMERICS must not start torch before the pins

    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def describe_machine(fingerprint: dict[str, str]) -> str:
    """One line for a results table: 'Intel(R) Xeon(R) Processor, AVX512, torch 2.14.1+cu130'."""
    return f"{fingerprint['cpu']}, {fingerprint['isa']}, torch {fingerprint['torch']}"
