"""Loading the user's own functions from ``path/to/file.py:function`` or ``package.module:function``.

One loader for every kind of plug-in that names a function in a config: reward functions
(:mod:`mmpo.rewards.user`) and tools (:mod:`mmpo.tools.functions`). It imports nothing heavy (no
torch), so the tool worker process can use it too.

- ``path/to/file.py:function``: the file is loaded by path (``importlib.util.spec_from_file_location``;
  a relative path is resolved from the working directory when the spec is parsed), as a module of its
  own name (``mmpo_user_<kind>_<stem>_<hash>``): its directory is not put on ``sys.path``;
- ``package.module:function``: imported with ``importlib.import_module`` (it must be on ``sys.path``).

Errors are :class:`PluginSpecError` (a ``ValueError``) naming the kind, the spec and the problem.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_SEPARATOR = ":"
"""Separates the file or module from the function name in a spec."""


class PluginSpecError(ValueError):
    """A spec that names no usable function; the message names the kind, the spec and the problem."""


@dataclass(frozen=True)
class PluginSpec:
    """A parsed spec: exactly one of ``file`` (absolute) and ``module`` is set."""

    text: str
    """The spec as the user wrote it (used in error messages)."""
    attribute: str
    file: Path | None = None
    module: str | None = None
    kind: str = "reward"
    """What the function is, for messages and module names: ``reward`` or ``tool``."""

    @property
    def canonical(self) -> str:
        """The spec with an absolute file path: the same function from any working directory."""
        return f"{self.file if self.file is not None else self.module}{SPEC_SEPARATOR}{self.attribute}"


def is_plugin_spec(name: str) -> bool:
    """True for ``file.py:fn`` / ``module:fn`` specs, False for registered names (no ``:``)."""
    return SPEC_SEPARATOR in name


def parse_spec(text: str, kind: str = "reward") -> PluginSpec:
    """Split ``file.py:fn`` or ``package.module:fn`` (a path is made absolute from the working directory).

    Raises:
        PluginSpecError: an empty file/module or function part, or a module name that is not dotted identifiers.
    """
    source, _, attribute = text.rpartition(SPEC_SEPARATOR)
    if not source or not attribute:
        raise PluginSpecError(f"{kind} {text!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    if not all(part.isidentifier() for part in attribute.split(".")):
        raise PluginSpecError(f"{kind} {text!r}: {attribute!r} is not a function name")
    if source.endswith(".py") or "/" in source or os.sep in source:
        return PluginSpec(text, attribute, file=Path(source).expanduser().resolve(), kind=kind)
    if not all(part.isidentifier() for part in source.split(".")):
        raise PluginSpecError(f"{kind} {text!r}: {source!r} is neither a .py file nor a dotted module name")
    return PluginSpec(text, attribute, module=source, kind=kind)


_FILE_MODULES: dict[Path, ModuleType] = {}
"""Files loaded by path in this process (each loaded once, like an import)."""

_LOAD_LOCK = threading.RLock()  # a plug-in file may itself resolve another one


def module_name_for(path: Path, kind: str = "reward") -> str:
    """The module name a file is loaded as: unique per absolute path, the same in every process."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = "".join(ch if ch.isalnum() else "_" for ch in path.stem)
    return f"mmpo_user_{kind}_{stem}_{digest}"


def load_file(spec: PluginSpec) -> ModuleType:
    """The module of ``spec.file``, loaded once per process."""
    path = spec.file
    assert path is not None
    with _LOAD_LOCK:
        if path in _FILE_MODULES:
            return _FILE_MODULES[path]
        if not path.is_file():
            raise PluginSpecError(f"{spec.kind} {spec.text!r}: file {str(path)!r} not found "
                                  f"(a relative path is read from the working directory {os.getcwd()!r})")
        name = module_name_for(path, spec.kind)
        import_spec = importlib.util.spec_from_file_location(name, path)
        if import_spec is None or import_spec.loader is None:
            raise PluginSpecError(f"{spec.kind} {spec.text!r}: {str(path)!r} cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(import_spec)
        sys.modules[name] = module  # dataclasses, pickling and typing inside the file look it up here
        try:
            import_spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[name]
            raise PluginSpecError(
                f"{spec.kind} {spec.text!r}: loading {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
        _FILE_MODULES[path] = module
        return module


def import_module(spec: PluginSpec) -> ModuleType:
    """``spec.module`` imported from ``sys.path``."""
    assert spec.module is not None
    try:
        return importlib.import_module(spec.module)
    except ModuleNotFoundError as exc:
        raise PluginSpecError(f"{spec.kind} {spec.text!r}: no module {exc.name!r} (is it installed or on "
                              "PYTHONPATH? a file is given as 'path/to/file.py:function')") from exc
    except BaseException as exc:
        raise PluginSpecError(
            f"{spec.kind} {spec.text!r}: importing {spec.module!r} failed: {type(exc).__name__}: {exc}") from exc


def function_of(spec: PluginSpec, module: ModuleType) -> Callable:
    """The callable ``spec.attribute`` (dotted) of ``module``; an error lists the functions defined there."""
    value: Any = module
    for part in spec.attribute.split("."):
        if not hasattr(value, part):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__)
            where = spec.file.name if spec.file is not None else spec.module
            raise PluginSpecError(f"{spec.kind} {spec.text!r}: {where} has no {spec.attribute!r}; "
                                  f"functions defined there: {defined}")
        value = getattr(value, part)
    if not callable(value):
        raise PluginSpecError(f"{spec.kind} {spec.text!r}: {spec.attribute!r} is a {type(value).__name__}, "
                              "not a function")
    return value


def load_function(spec: PluginSpec) -> Callable:
    """The function a parsed spec names (its file loaded by path, or its module imported)."""
    module = load_file(spec) if spec.file is not None else import_module(spec)
    return function_of(spec, module)
