"""A Python execution tool: run a snippet and return what it printed (and the value of a last expression).

It runs inside the sandbox's per-call child process (:mod:`mmpo.tools.sandbox`), which already holds
the OS-level limits (deadline, CPU time, memory, file size, a private working directory). On top of
those, this module restricts the snippet at the Python level (best-effort, not a security boundary):

- imports only from :data:`ALLOWED_MODULES` (no ``os``, ``sys``, ``subprocess``, ``socket``, ``shutil``,
  ``ctypes``, ``importlib``, ...): no process, file-system or network module is reachable by import;
- ``open`` only for paths inside the working directory (after resolving ``..`` and links);
- no names or attributes starting with ``_`` (blocks ``().__class__.__subclasses__()`` and module
  internals such as ``random._os``), no ``getattr`` / ``setattr`` / ``vars`` / ``globals`` / ``eval`` /
  ``exec`` / ``compile`` / ``input`` / ``breakpoint``;
- printed output is capped (:class:`CappedWriter`): a snippet that prints without bound stops with an error.
"""

from __future__ import annotations

import ast
import builtins
import io
import os
from pathlib import Path
from typing import Any

ALLOWED_MODULES = frozenset({
    "math", "cmath", "random", "statistics", "itertools", "functools", "collections", "fractions", "decimal",
    "re", "json", "string", "heapq", "bisect", "datetime", "operator", "numbers", "typing", "dataclasses",
    "copy", "textwrap", "enum",
})
"""Modules a snippet may import (and their submodules)."""

_REMOVED_BUILTINS = ("open", "__import__", "eval", "exec", "compile", "input", "breakpoint", "getattr", "setattr",
                     "delattr", "vars", "globals", "locals", "help", "exit", "quit", "memoryview")

DEFAULT_MAX_PRINTED_CHARS = 10_000


class SandboxViolation(PermissionError):
    """The snippet tried something the Python tool does not allow."""


class OutputLimitExceeded(RuntimeError):
    """The snippet printed more than the cap."""


class CappedWriter(io.StringIO):
    """A ``sys.stdout`` that raises :class:`OutputLimitExceeded` once more than ``limit`` characters are written."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, text: str) -> int:
        if self.tell() + len(text) > self.limit:
            raise OutputLimitExceeded(f"printed more than {self.limit} characters")
        return super().write(text)


def _restricted_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    if level != 0 or name.split(".")[0] not in ALLOWED_MODULES:
        raise SandboxViolation(f"import of {name!r} is not allowed (math, fractions, itertools, statistics, ... are)")
    return builtins.__import__(name, globals, locals, fromlist, level)


def _confined_open(root: Path) -> Any:
    def open_inside(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not isinstance(file, (str, os.PathLike)):
            raise SandboxViolation("open takes a path inside the working directory")
        path = Path(os.path.realpath(root / file))
        if path != root and root not in path.parents:
            raise SandboxViolation(f"open({str(file)!r}): only files inside the working directory can be opened")
        return builtins.open(path, mode, *args, **kwargs)

    return open_inside


def _check_tree(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name is not None and name.startswith("_"):
            raise SandboxViolation(f"names starting with '_' are not allowed ({name!r})")


def run_python(code: str, *, max_printed_chars: int = DEFAULT_MAX_PRINTED_CHARS) -> str:
    """Run ``code`` with restricted builtins in the current working directory; return its printed output,
    followed by the repr of the last statement's value when that statement is an expression (as a REPL)."""
    tree = ast.parse(code, mode="exec")
    _check_tree(tree)
    last_expression = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last_expression = ast.Expression(tree.body.pop().value)
    safe_builtins = {k: v for k, v in vars(builtins).items() if k not in _REMOVED_BUILTINS}
    safe_builtins["__import__"] = _restricted_import
    safe_builtins["open"] = _confined_open(Path(os.path.realpath(os.getcwd())))
    namespace: dict[str, Any] = {"__builtins__": safe_builtins, "__name__": "__tool__"}
    writer = CappedWriter(max_printed_chars)
    safe_builtins["print"] = lambda *args, **kwargs: builtins.print(*args, **{**kwargs, "file": writer})
    exec(compile(tree, "<tool>", "exec"), namespace)  # noqa: S102 - restricted namespace, in the sandbox child
    value = None
    if last_expression is not None:
        value = eval(compile(last_expression, "<tool>", "eval"), namespace)  # noqa: S307 - same namespace
    return writer.getvalue() + ("" if value is None else repr(value))


def python(code: str) -> str:
    """Run a short Python snippet and return what it printed (and the value of its last line if that is an expression).

    Args:
        code: Python source code; only modules such as math, fractions, itertools and statistics can be imported.
    """
    return run_python(code)
