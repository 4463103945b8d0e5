"""The MPO testbed: a rule judge that scores a rubric made of checks, a rule meta judge that closes the gap a
gamed rubric leaves, and a hidden oracle (the answer is right).

A rubric item is one of three checks (anything else scores 0):

- ``mentions "<word>"``: 1 when the response contains the word (case-insensitive) - gameable by keyword;
- ``at least <n> words``: 1 when the response has n or more words - gameable by length;
- ``the final answer matches the reference``: 1 when ``extract_answer(response)`` matches the reference
  (``mmpo.rewards.answers``) - the oracle itself.

:class:`RuleJudge` reads the rubric, the response and the reference from the tagged judge prompt
(``<rubric>``, ``<response>``, ``<reference>``; :data:`JUDGE_RUBRIC`) and replies one ``<score>0|1</score>`` per
item (judge settings: ``score_pattern: <score>(\\d+)</score>``, ``score_reduce: sum``, ``normalize: false``).
:class:`RuleMetaJudge` answers MPO's analyse request (mmpo.algos.mpo.DEFAULT_ANALYZE_PROMPT, which it parses by
its tags): when a sample scored above 0 but its answer is wrong (the meta judge sees the reference, as the
official meta reward model sees the task), the rubric is being gamed and it proposes the rubric's items plus
the answer check; otherwise the rubric's items. A merge request gets every distinct item back. Both are
deterministic: they exist so MPO's loop can be tested and measured without a language model.
"""

from __future__ import annotations

import re
from typing import Any

from mmpo.rewards.answers import answers_match, extract_answer
from mmpo.rewards.models import ModelRewardSpec, ResponseCache

ANSWER_CHECK = "the final answer matches the reference"

JUDGE_RUBRIC = ("Score the response with each item of the rubric.\n{rubric}\n"
                "<question>{prompt}</question>\n<reference>{answer}</reference>\n<response>{completion}</response>\n"
                "Reply <score>0</score> or <score>1</score> per item, in order.")
"""The judge's prompt template for the testbed (a ``{rubric}``-conditioned rubric, mmpo.algos.mpo)."""

_MENTIONS = re.compile(r'mentions\s+"([^"]+)"', re.IGNORECASE)
_WORDS = re.compile(r"at least\s+(\d+)\s+words", re.IGNORECASE)


def _tag(text: str, name: str) -> str | None:
    match = re.search(rf"<{name}>(.*?)</{name}>", text, re.DOTALL)
    return None if match is None else match.group(1)


def _items(text: str) -> list[str]:
    return [item.strip() for item in re.findall(r"<item>(.*?)</item>", text, re.DOTALL) if item.strip()]


def check(item: str, response: str, reference: str) -> int:
    """1 when ``response`` passes the rubric ``item`` (module docstring), else 0."""
    mentions = _MENTIONS.search(item)
    if mentions:
        return int(mentions.group(1).lower() in response.lower())
    words = _WORDS.search(item)
    if words:
        return int(len(response.split()) >= int(words.group(1)))
    if ANSWER_CHECK in item.lower():
        return int(answers_match(extract_answer(response), reference))
    return 0


def oracle(response: str, reference: str) -> float:
    """The hidden oracle: 1.0 when the final answer matches the reference."""
    return float(answers_match(extract_answer(response), reference))


class RuleJudge:
    """The testbed's judge backend (``backend: mmpo.algos.mpo_testbed:RuleJudge``)."""

    def __init__(self, spec: ModelRewardSpec | None = None) -> None:
        self.cache = ResponseCache(0)

    def reply(self, text: str) -> str:
        rubric, response, reference = _tag(text, "rubric"), _tag(text, "response"), _tag(text, "reference")
        if rubric is None or response is None or reference is None:
            return "I cannot find the rubric, the response or the reference."
        return "".join(f"<score>{check(item, response, reference)}</score>" for item in _items(rubric))

    def generate(self, texts: list[str], images: list[list[Any]]) -> list[str]:
        return [self.reply(text) for text in texts]


class RuleMetaJudge:
    """The testbed's meta judge (``mpo_meta_judge: {backend: mmpo.algos.mpo_testbed:RuleMetaJudge}``)."""

    def __init__(self, spec: ModelRewardSpec | None = None) -> None:
        self.cache = ResponseCache(0)

    def reply(self, text: str) -> str:
        response = _tag(text, "response")
        if response is None:  # a merge request: every distinct item, in order
            return "\n".join(f"<item>{item}</item>" for item in dict.fromkeys(_items(text)))
        rubric = _tag(text, "rubric") or ""
        items = _items(rubric)
        score = _tag(text, "score")
        reference = _tag(text, "reference") or ""
        try:
            scored = float(score) > 0 if score is not None else False
        except ValueError:
            scored = False
        gamed = scored and not oracle(response, reference)
        if gamed and not any(ANSWER_CHECK in item.lower() for item in items):
            items = [*items, ANSWER_CHECK]
        analysis = "The score rewards a wrong answer." if gamed else "The score is consistent."
        return analysis + "\n" + "\n".join(f"<item>{item}</item>" for item in items)

    def generate(self, texts: list[str], images: list[list[Any]]) -> list[str]:
        return [self.reply(text) for text in texts]
