"""tests/vlm/test_vllm_engine.py needs vLLM, which lives in its own venv (docs/vllm.md): where vLLM is not
importable the file is not collected, and pytest's header says so."""

import importlib.util

VLLM_TESTS = "test_vllm_engine.py"
HAS_VLLM = importlib.util.find_spec("vllm") is not None

collect_ignore = [] if HAS_VLLM else [VLLM_TESTS]


def pytest_report_header(config):
    if HAS_VLLM:
        return "vllm: importable, tests/vlm/test_vllm_engine.py runs"
    return ("vllm: not importable here, tests/vlm/test_vllm_engine.py not collected (run it in the vLLM venv: "
            ".venv-vllm/bin/python -m pytest tests/vlm/test_vllm_engine.py; docs/vllm.md)")
