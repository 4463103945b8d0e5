"""Optional extras of mmpo: the error that names a missing one.

The base install (``pip install mmpo``) trains and evaluates VLMs and masked-diffusion LMs; a
package that needs an extra's dependencies checks them when it is imported (``mmpo.robotics``: its
``__init__`` calls ``require_extra("mmpo.robotics", "robotics")``) and raises :class:`MissingExtraError`, whose message is one line naming
the extra and what is missing. ``mmpo`` (mmpo/cli.py, and mmpo/training/cli_errors.py under
LightningCLI) prints that line and exits with code 2 instead of a traceback.

This module imports nothing outside the standard library, so the CLI can catch the error
without importing the package that raised it.
"""

from __future__ import annotations

import importlib.util

# extra -> the modules that only it installs and its package imports (import name -> distribution name).
# robotics: robomimic and imageio are in the extra too (pyproject.toml), but mmpo.robotics does not need
# them to import: robomimic is used by the tests only, imageio only by `mmpo rollout --video` (lazily).
EXTRA_MODULES: dict[str, dict[str, str]] = {
    "robotics": {"robosuite": "robosuite", "mujoco": "mujoco", "gymnasium": "gymnasium", "h5py": "h5py"},
}


class MissingExtraError(ImportError):
    """An optional extra of mmpo is not installed; the message says which and how to install it."""


def missing_extra_message(package: str, extra: str, missing: list[str]) -> str:
    return f"{package} needs the '{extra}' extra: pip install \"mmpo[{extra}]\" (missing: {', '.join(missing)})"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a half-imported module
        return False


def missing_modules(modules: dict[str, str]) -> list[str]:
    """The distributions (``modules``' values) whose import name (the keys) cannot be found."""
    return [dist for name, dist in modules.items() if not _importable(name)]


def require_extra(package: str, extra: str, modules: dict[str, str] | None = None) -> None:
    """Raise :class:`MissingExtraError` unless ``extra``'s modules (``EXTRA_MODULES``, or ``modules``) are found."""
    modules = EXTRA_MODULES[extra] if modules is None else modules
    missing = missing_modules(modules)
    if missing:
        first = next(name for name, dist in modules.items() if dist == missing[0])
        raise MissingExtraError(missing_extra_message(package, extra, missing), name=first)


def find_missing_extra(exc: BaseException | None) -> MissingExtraError | None:
    """The :class:`MissingExtraError` that ``exc`` is or was raised from (``__cause__`` / ``__context__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, MissingExtraError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
