"""Shared pieces of the per-family golden artifacts (tests/{algos,dllm,robotics}/golden): loading a
generator script, the gradient fingerprint they store, and the comparison the tests make."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


def load_script(path: Path) -> ModuleType:
    """Import a generator script (``make_golden.py``) by path; tests are not a package."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_golden(golden_dir: Path, artifact: str) -> tuple[ModuleType, dict[str, Any]]:
    """(the generator ``golden_dir/make_golden.py``, the committed artifact ``golden_dir/artifact``)."""
    return load_script(golden_dir / "make_golden.py"), json.loads((golden_dir / artifact).read_text())


def gradient_fingerprint(values: torch.Tensor | None, name: str, shape: torch.Size | None = None) -> list[float]:
    """[sum, sum of squares, projection on a fixed random direction seeded by ``name``] in float64:
    a change of a formula moves at least one of them. ``values`` None (no gradient) counts as zeros."""
    values = torch.zeros(shape, dtype=torch.float64) if values is None else values.detach().to(torch.float64)
    direction = torch.randn(values.shape, generator=torch.Generator().manual_seed(sum(map(ord, name))),
                            dtype=torch.float64)
    return [float(values.sum()), float(values.pow(2).sum()), float((values * direction).sum())]


def assert_step_matches(current: dict[str, Any], golden: dict[str, Any], *, metric_rel: float, grad_rel: float) -> None:
    """Every stored metric is still there with the same value (new metrics may be added), and every
    parameter's gradient fingerprint matches to ``grad_rel`` of that gradient's norm.

    Why the norm and not each component: the plain sum of a gradient can cancel to ~0 (an lm_head's
    gradient sums to zero over the vocabulary), so its relative error is rounding noise; another processor
    type (AVX2 vs AVX-512 kernels) moved such sums by 50% of themselves while moving every component by
    < 3e-7 of the norm (measured 2026-12-01). A formula change moves the norm-scaled values far more."""
    for key, value in golden["metrics"].items():
        assert key in current["metrics"], key
        assert current["metrics"][key] == pytest.approx(value, rel=metric_rel, abs=1e-10), key
    assert sorted(current["grad"]) == sorted(golden["grad"])
    for param, fingerprint in golden["grad"].items():
        norm = abs(fingerprint[1]) ** 0.5  # fingerprint = [sum, sum of squares, projection]
        assert current["grad"][param] == pytest.approx(fingerprint, rel=grad_rel, abs=max(grad_rel * norm, 1e-12)), param
