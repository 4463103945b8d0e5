"""Test-wide settings: single-threaded torch (CI has 2 cores, pytest-xdist runs 2 workers),
no hub access (everything is built locally), headless rendering."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

# tests/ on the path: shared test helpers (golden_support) import by name under --import-mode=importlib
sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(1)


VLLM_TEST_FILES = ("tests/vlm/test_vllm_engine.py", "tests/vlm/test_vllm_multiturn.py", "tests/llm/test_vllm_text_engine.py",
                   "tests/llm/test_vllm_multiturn.py", "tests/llm/test_vllm_arpo.py", "tests/llm/test_vllm_matpo.py")


def pytest_report_header(config):
    """Whether the vLLM backend's tests run here (tests/vlm/conftest.py and tests/llm/conftest.py leave them
    out without vLLM)."""
    import importlib.util

    files = " and ".join(VLLM_TEST_FILES)
    if importlib.util.find_spec("vllm") is not None:
        return f"vllm: importable, {files} run"
    return (f"vllm: not importable here, {files} not collected (run them in the vLLM venv: "
            f".venv-vllm/bin/python -m pytest {' '.join(VLLM_TEST_FILES)}; docs/vllm.md)")
