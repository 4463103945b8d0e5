"""A very small tiny VLM for module-level tests (shared by name: tests/ is on sys.path, see conftest.py)."""

from __future__ import annotations

from pathlib import Path


def build_small_vlm(directory: Path, *, hidden_size: int = 32, intermediate_size: int = 64) -> str:
    """``build_tiny_vlm`` with a 300-token vocabulary trained on one prompt/solution pair; returns its path."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> 0123456789"] * 10
    return str(build_tiny_vlm(directory, corpus=corpus, vocab_size=300, hidden_size=hidden_size,
                              intermediate_size=intermediate_size))
