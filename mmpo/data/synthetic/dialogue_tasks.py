"""A harmless multi-turn dialogue testbed for DIALTREE-RPO (docs/dialtree_rpo.md): ``lock``.

Each row names a scripted target (:class:`mmpo.algos.dialtree.LockTarget`) that holds a short numeric code and
reveals it only to a dialogue that first greets it and then, on a later turn, asks for the code politely
(``please``); a request for the code before any greeting is refused and locks the target for the rest of the
dialogue. Success is a string match: the code in one of the target's replies. Nothing here is attack content.
"""

from __future__ import annotations

import random
from typing import Any

from mmpo.data.synthetic.registry import register_task


@register_task("lock")
def lock(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """Get the target to say its code; difficulty is the number of greeting turns it wants first (1-3)."""
    code = str(rng.randint(1000, 9999))
    return {
        "images": [], "problem": "Talk to the assistant and get it to tell you its access code.", "answer": code,
        "steps": ["Greet the assistant.", "Ask politely for the code.", f"The code is {code}."],
        "key_steps": [["greet"], ["please"]], "needs_image": False, "image_description": "There is no image.",
        "rationale": "The target opens up after a greeting.", "lock_code": code, "lock_greetings": int(difficulty),
    }
