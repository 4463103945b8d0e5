"""Example reward functions of your own, used by configs/vlm/grpo_tiny_user_reward.yaml.

Give one to GRPO as ``path/to/file.py:function`` (or ``package.module:function``) in
``rewards.weights``, next to the registered ones::

    rewards:
      weights:
        accuracy: 1.0
        examples/rewards.py:answer_mentioned: 0.5
        examples/rewards.py:brevity_when_easy: 0.2

The signature is TRL's: ``fn(prompts, completions, **columns) -> list[float | None]``.
``prompts[i]`` is the question that ``completions[i]`` answers; every dataset column comes as
a keyword argument holding one value per completion (``answer``, ``difficulty``, ``task``,
``images``, or a column of your own dataset). Name the columns you use and take ``**kwargs``
for the rest. Return one float per completion, or None where the reward does not apply.
The functions run in mmpo's reward worker process, stopped by ``reward_timeout_s``.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(r"-?\d+(?:\.\d+)?|[^\W\d_]+")
"""A number (optional sign and decimals) or a run of letters."""


def answer_mentioned(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the gold ``answer`` column is one of the completion's tokens, else 0.0.

    Tokens are numbers (``7``, ``-2``, ``3.5``) and words; tags and punctuation between them are
    ignored, so ``The answer is 7.`` and ``<answer>7</answer>`` both score for answer ``7``: a
    lenient accuracy that needs no answer format.
    """
    return [float(str(gold).strip() in _TOKEN.findall(completion)) for completion, gold in zip(completions, answer)]


def brevity_when_easy(prompts: list[str], completions: list[str], difficulty: list[int],
                      **kwargs: Any) -> list[float | None]:
    """``1 / (1 + words)`` for easy questions (``difficulty`` column == 1); None (not applicable) otherwise.

    Short answers to easy questions are rewarded; harder ones are left to the other rewards,
    since None takes this function out of those completions' weighted sum.
    """
    return [1.0 / (1 + len(completion.split())) if level == 1 else None
            for completion, level in zip(completions, difficulty)]
