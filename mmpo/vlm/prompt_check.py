"""Prompt lengths checked when training starts, before the first step (verl's ``filter_overlong_prompts``).

Every training prompt is encoded as the rollout encodes it (chat template, system prompt, image tokens)
and its token count compared with the limit: ``max_prompt_length`` and the model's context less the
completion budget, ``max_position_embeddings - sampling.max_new_tokens``, whichever is smaller (the
second applies even when ``max_prompt_length`` is null). Offending rows are named in one error (row
index, id, length, limit), or, with the data module's ``skip_bad_rows: true``, dropped from the
training rows, counted in ``load_stats["train"]["overlong_skipped"]`` and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from mmpo.vlm.processing import encode_prompts

log = logging.getLogger(__name__)

#: prompts encoded per processor call while measuring (bounds the images decoded at once)
MEASURE_CHUNK = 16


@dataclass(frozen=True)
class PromptLimit:
    """The longest allowed prompt and where it comes from (for the error message)."""

    tokens: int
    reason: str


def model_context_length(model: Any) -> int | None:
    """``max_position_embeddings`` of the model's (text) config, or None when it declares none."""
    config = getattr(model, "config", None)
    for candidate in (getattr(config, "text_config", None), config):
        value = getattr(candidate, "max_position_embeddings", None)
        if isinstance(value, int):
            return value
    return None


def prompt_limit(max_prompt_length: int | None, context_length: int | None, max_new_tokens: int) -> PromptLimit | None:
    """The smaller of ``max_prompt_length`` and ``context_length - max_new_tokens``; None when neither is set."""
    limits = []
    if max_prompt_length is not None:
        limits.append(PromptLimit(max_prompt_length, f"max_prompt_length {max_prompt_length}"))
    if context_length is not None:
        limits.append(PromptLimit(context_length - max_new_tokens,
                                  f"the model's {context_length} positions - max_new_tokens {max_new_tokens}"))
    return min(limits, key=lambda limit: limit.tokens) if limits else None


def measure_prompt_lengths(processor: Any, rows: Sequence[Any], *, system_prompt: str | None) -> list[int]:
    """Token count of each row's prompt exactly as the rollout encodes it (images included)."""
    lengths: list[int] = []
    for start in range(0, len(rows), MEASURE_CHUNK):
        chunk = [rows[i] for i in range(start, min(start + MEASURE_CHUNK, len(rows)))]
        encoded = encode_prompts(processor, chunk, system_prompt=system_prompt)
        lengths += encoded["attention_mask"].sum(-1).tolist()
    return lengths


def check_training_prompts(datamodule: Any, processor: Any, *, system_prompt: str | None,
                           limit: PromptLimit | None) -> int:
    """Check ``datamodule.train_rows`` against ``limit``; returns the number of rows skipped.

    Raises ValueError naming every offending row (up to 10, then a count) unless the data module has
    ``skip_bad_rows`` set, in which case they leave ``datamodule.train_rows`` and are counted.
    """
    rows = getattr(datamodule, "train_rows", None)
    if limit is None or not rows:
        return 0
    if limit.tokens < 1:
        raise ValueError(f"no room for a prompt: {limit.reason} leaves {limit.tokens} tokens")
    lengths = measure_prompt_lengths(processor, rows, system_prompt=system_prompt)
    over = [(i, n) for i, n in enumerate(lengths) if n > limit.tokens]
    if not over:
        return 0
    if not getattr(datamodule, "skip_bad_rows", False):
        named = ", ".join(f"row {i} (id {rows[i].get('id')!r}): {n} tokens" for i, n in over[:10])
        more = f" and {len(over) - 10} more" if len(over) > 10 else ""
        raise ValueError(f"{len(over)} training prompt(s) longer than {limit.tokens} tokens ({limit.reason}): "
                         f"{named}{more}; raise max_prompt_length, lower max_pixels or set data skip_bad_rows: true")
    dropped = {i for i, _ in over}
    datamodule.train_rows = [rows[i] for i in range(len(rows)) if i not in dropped]
    stats = getattr(datamodule, "load_stats", None)
    if isinstance(stats, dict):
        stats.setdefault("train", {})["overlong_skipped"] = len(over)
    log.warning("skipped %d of %d training prompts longer than %d tokens (%s)", len(over), len(rows),
                limit.tokens, limit.reason)
    if not datamodule.train_rows:
        raise ValueError(f"every training prompt is longer than {limit.tokens} tokens ({limit.reason})")
    return len(over)
