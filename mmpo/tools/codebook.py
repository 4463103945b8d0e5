"""A codebook tool: the 2-digit code of a short key, a value nothing but the tool knows (the ``codebook`` task).

The code is a hash of the key (``10 + sha256("codebook:" + key) mod 90``), so the tool needs no state, the task
knows every answer, and a model that has not seen a key cannot guess its code (1 chance in 90). Keys and codes
are short and tokenise the same way in the prompt, the call and the answer (each follows a quote or a newline),
so the tool-use skill is two copies: the prompt's key into the call, the tool's answer into the final answer.
"""

from __future__ import annotations

import hashlib


def code_of(key: str) -> int:
    """The code of ``key`` (10..99)."""
    digest = hashlib.sha256(("codebook:" + key).encode()).digest()
    return 10 + int.from_bytes(digest[:8], "big") % 90


def codebook(key: str) -> str:
    """Look up the code of a key in the codebook.

    Args:
        key: the key, e.g. "bam".
    """
    key = key.strip()
    if not key:
        raise ValueError("key must not be empty")
    return str(code_of(key))
