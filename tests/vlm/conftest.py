"""tests/vlm/test_vllm_engine.py and test_vllm_multiturn.py need vLLM, which lives in its own venv (docs/vllm.md):
where vLLM is not importable the files are not collected (pytest's header says so: tests/conftest.py)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["test_vllm_engine.py", "test_vllm_multiturn.py"]
