"""Keeping model output out of the log: a pathological 200k-character answer must not be
dumped into a warning. Messages that may quote a completion or an answer are shortened."""

from __future__ import annotations

import logging

MAX_LOGGED_CHARS = 200
"""Longest completion, answer or error text written into a log message."""


def shorten(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` if at most ``limit`` characters, else its first ``limit`` and ``"... (N chars)"``.

    Example: ``shorten("x" * 500)`` -> ``"xxx...x... (500 chars)"`` with 200 ``x``.
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class TruncatingFilter(logging.Filter):
    """Shortens every record's formatted message to ``limit`` characters (for third-party
    loggers such as math-verify's, which log the whole unparsed answer)."""

    def __init__(self, limit: int = MAX_LOGGED_CHARS) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self.limit:
            record.msg, record.args = shorten(message, self.limit), None
        return True
