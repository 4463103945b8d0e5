"""Reject (or skip and count) demos with NaN/inf observations or actions.

One NaN action in a demo file used to train a policy that outputs only NaN. Every demo is
checked when it is loaded for training; ``on_nonfinite="error"`` (the default) names the first
bad demo, step and column, ``"skip"`` drops whole demos (a chunk needs consecutive steps) and
counts them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mmpo.robotics.data.robomimic_io import Demo

log = logging.getLogger(__name__)

ON_NONFINITE = ("error", "skip")


def first_nonfinite(demo: Demo) -> tuple[str, int, int, float] | None:
    """``(array name, step, column, value)`` of the first NaN/inf in the demo's obs or actions, else None."""
    for name in ("obs", "actions"):
        values = np.asarray(getattr(demo, name))
        bad = ~np.isfinite(values.reshape(values.shape[0], -1))
        if bad.any():
            step, column = (int(i) for i in np.argwhere(bad)[0])
            return name, step, column, float(values.reshape(values.shape[0], -1)[step, column])
    return None


def drop_nonfinite_demos(
    demos: list[Demo], source: str | Path, on_nonfinite: str = "error"
) -> tuple[list[Demo], list[str]]:
    """``(finite demos, names of the skipped ones)``; raises ValueError on the first bad demo
    with ``on_nonfinite="error"``, or when no finite demo is left."""
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    kept, skipped = [], []
    for demo in demos:
        found = first_nonfinite(demo)
        if found is None:
            kept.append(demo)
            continue
        name, step, column, value = found
        where = f"{source}: {demo.name}, step {step}: {name}[{column}] = {value}"
        if on_nonfinite == "error":
            raise ValueError(f"non-finite value in {where}; fix the demo or set on_nonfinite='skip' to drop such demos")
        log.warning("skipping demo with a non-finite value (%s)", where)
        skipped.append(demo.name)
    if not kept:
        raise ValueError(f"{source}: every demo holds a non-finite observation or action ({len(skipped)} skipped)")
    return kept, skipped
