"""What decides the last bits of a one-thread CPU run besides the code, recorded next to results.

The processor model and the SIMD level torch dispatches to (AVX2 and AVX-512 kernels round differently)
change long CPU runs: on 2026-12-01 the same 500-step dLLM SFT gave different weights with
``ATEN_CPU_CAPABILITY=avx2`` and with the machine's AVX-512 default. Results recorded as "exact" are exact
on the processor type they name, within rounding drift elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_fingerprint() -> dict[str, str]:
    """{"cpu": model name, "isa": torch's CPU capability, "torch": version}."""
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
