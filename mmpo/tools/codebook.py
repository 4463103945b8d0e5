"""A codebook tool: the code of a short key, a value nothing but the tool knows (the ``codebook`` task).

The code is an upper-case letter and a digit (``K7``: 260 codes), a hash of the key (``sha256("codebook:" + key)``),
so the tool needs no state, the task knows every answer, and a model that has not seen a key cannot guess its
code (1 chance in 260). Keys (``b7k``) and codes alternate letters and digits, so a byte-level BPE cuts every
character into its own token wherever it appears (prompt, call, tool answer, final answer): the tool-use skill is
two copies of fixed length, the prompt's key into the call and the tool's code into the answer.
"""

from __future__ import annotations

import hashlib


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"


def code_of(key: str) -> str:
    """The code of ``key``: with n the first 8 bytes of sha256("codebook:" + key) as a big-endian integer,
    ``LETTERS[n // 10 % 26] + DIGITS[n % 10]``."""
    number = int.from_bytes(hashlib.sha256(("codebook:" + key).encode()).digest()[:8], "big")
    return LETTERS[number // 10 % 26] + DIGITS[number % 10]


def codebook(key: str) -> str:
    """Look up the code of a key in the codebook.

    Args:
        key: the key, e.g. "b7k".
    """
    key = key.strip()
    if not key:
        raise ValueError("key must not be empty")
    return code_of(key)
