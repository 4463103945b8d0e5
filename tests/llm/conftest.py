"""tests/llm/test_vllm_text_engine.py, test_vllm_multiturn.py, test_vllm_arpo.py and test_vllm_matpo.py need vLLM,
which lives in its own venv (docs/vllm.md): where vLLM is not importable the files are not collected (pytest's header
says so: tests/conftest.py)."""

import importlib.util

VLLM_FILES = ["test_vllm_text_engine.py", "test_vllm_multiturn.py", "test_vllm_arpo.py", "test_vllm_matpo.py"]
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else VLLM_FILES
