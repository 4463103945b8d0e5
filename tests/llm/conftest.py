"""tests/llm/test_vllm_text_engine.py needs vLLM, which lives in its own venv (docs/vllm.md): where vLLM is not
importable the file is not collected (pytest's header says so: tests/conftest.py)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["test_vllm_text_engine.py"]
