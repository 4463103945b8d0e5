"""Importing a bench script (bench/*.py) in tests: the scripts are not a package; each is loaded from its file.

The scripts import only the installed ``mmpo`` package (never each other), so no ``sys.path`` change is needed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module named ``bench_script_<name>`` (registered in ``sys.modules`` while it is
    executed: dataclasses look their module up while a class is built)."""
    module_name = f"bench_script_{name}"
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
