"""Check user settings against a registered function's keyword parameters."""

from __future__ import annotations

import inspect
from typing import Callable


def check_settings(
    fn: Callable, settings: dict, *, family: str, name: str, num_tensor_args: int, reserved: tuple[str, ...] = ()
) -> None:
    """Raise ValueError naming any setting ``fn`` does not accept (instead of a bare TypeError).

    The first ``num_tensor_args`` parameters are the family's shared tensor arguments and
    ``reserved`` names are filled in by the dispatcher; neither can be passed as a setting.
    A function taking ``**kwargs`` accepts anything.
    """
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    keyword_kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    accepted = [
        p.name for p in params[num_tensor_args:] if p.kind in keyword_kinds and p.name not in reserved
    ]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"{family} {name!r} got unknown setting(s) {unknown}; accepted settings: {sorted(accepted)}")
