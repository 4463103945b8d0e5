"""Check user settings against a registered function's keyword parameters."""

from __future__ import annotations

import inspect
from typing import Callable


def check_settings(fn: Callable, settings: dict, *, family: str, name: str, reserved: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming any setting ``fn`` does not accept (instead of a bare TypeError)."""
    params = inspect.signature(fn).parameters
    accepted = [
        p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in reserved
    ]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"{family} {name!r} got unknown setting(s) {unknown}; accepted settings: {sorted(accepted)}")
