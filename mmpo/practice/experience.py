"""Training-Free GRPO's experience library: parsing the extractor's outputs, the group filter, applying
ADD / UPDATE / DELETE / NONE operations, and the prompt text that injects the library.

Everything here is a pure function of strings and dicts, transcribed in behaviour from the official code
(TencentCloudADP/youtu-agent, ``utu/practice/experience_updater.py``; the prompt wrappers from
``utu/prompts/practice/processor.yaml`` and ``utu/practice/training_free_grpo.py``):

- :func:`extract_experiences`: the ``<Experiences>...</Experiences>`` block of a group-advantage answer
  (``_group_advantage``'s regex, DOTALL and case-insensitive; "" when absent);
- :func:`parse_operations`: the JSON array after the last ```` ```json ```` fence (``_group_update`` and
  ``_batch_update``: ``response.split("```json")[-1].split("```")[0]``), checked to be a list of objects;
- :func:`partially_correct`: only groups with ``0 < mean reward < 1`` are summarised and critiqued;
- :func:`apply_operations`: ``_batch_update``'s application loop (missing ``operation`` = ADD, empty content
  skipped, UPDATE of an unknown id adds, DELETE of an unknown id is ignored, NONE changes nothing; new ids
  count up from the library's size before the batch), followed by ``run``'s renumbering to ``G0, G1, ...``.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Mapping, Sequence

#: ``_group_advantage``'s pattern for the experiences block
EXPERIENCES_PATTERN = re.compile(r"<Experiences>\s*(.*?)\s*</Experiences>", re.DOTALL | re.IGNORECASE)

OPERATIONS = ("ADD", "UPDATE", "DELETE", "NONE")


class OperationFormatError(ValueError):
    """An extractor answer whose operations cannot be read (the official loop drops that group / retries)."""


def extract_experiences(response: str) -> str:
    """The text inside ``<Experiences>...</Experiences>`` (stripped), or "" when the block is absent."""
    match = EXPERIENCES_PATTERN.search(response)
    return match.group(1).strip() if match else ""


def parse_operations(response: str) -> list[dict[str, Any]]:
    """The operations list of a group-update or batch-update answer.

    The JSON is what follows the last ```` ```json ```` fence up to the next ```` ``` ```` (the whole text
    when there is no fence), as in the official code. Raises :class:`OperationFormatError` when it is not
    a JSON array of objects or an object's ``operation`` is not one of ADD, UPDATE, DELETE, NONE.
    """
    body = response.split("```json")[-1].split("```")[0]
    try:
        operations = json.loads(body)
    except json.JSONDecodeError as error:
        raise OperationFormatError(f"operations are not valid JSON ({error.msg} at char {error.pos})") from None
    if not isinstance(operations, list) or not all(isinstance(op, dict) for op in operations):
        raise OperationFormatError(f"operations must be a JSON array of objects, got {type(operations).__name__}")
    for op in operations:
        name = op.get("operation", "ADD")
        if name not in OPERATIONS:
            raise OperationFormatError(f"unknown operation {name!r} (expected one of {', '.join(OPERATIONS)})")
    return operations


def partially_correct(rewards: Sequence[float]) -> bool:
    """True when the group's mean reward is strictly between 0 and 1 (the groups the official loop learns from)."""
    if not rewards:
        return False
    mean = sum(rewards) / len(rewards)
    return 0 < mean < 1


def apply_operations(experiences: Mapping[str, str], operations: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The library after ``operations``, renumbered ``G0, G1, ...`` in insertion order (the input is not changed).

    Bookkeeping as ``_batch_update`` then ``run``: ids of added experiences are ``str(len(experiences))``,
    ``str(len(experiences) + 1)``, ... (counted from the size before the batch, so a DELETE does not free
    an id); an operation with empty content is skipped, a DELETE included.
    """
    max_id = len(experiences)
    updated = copy.deepcopy(dict(experiences))
    for op in operations:
        name = op.get("operation", "ADD")
        content = op.get("content", "")
        target = op.get("id", None)
        if not content:
            continue
        if name == "ADD":
            updated[f"{max_id}"] = content
            max_id += 1
        elif name == "UPDATE":
            if target in updated:
                updated[target] = content
            else:
                updated[f"{max_id}"] = content
                max_id += 1
        elif name == "DELETE":
            if target in updated:
                del updated[target]
    return {f"G{index}": text for index, text in enumerate(updated.values())}


def format_experiences(experiences: Mapping[str, str]) -> str:
    """``[G0]. first\\n[G1]. second`` (the official listing), or "None" for an empty library."""
    return "\n".join(f"[{key}]. {text}" for key, text in experiences.items()) or "None"


def problem_with_experiences(problem: str, experiences: Mapping[str, str]) -> str:
    """The practice prompt (``processor.yaml`` ``PROBLEM_WITH_EXPERIENCE_TEMPLATE``): the problem, then the library."""
    return (f"Please solve the problem:\n{problem}\n\nWhen solving problems, you MUST first carefully read and "
            f"understand the helpful instructions and experiences:\n{format_experiences(experiences)}")


def system_with_experiences(system_prompt: str, experiences: Mapping[str, str]) -> str:
    """The deployed form (``_create_agent_config_with_experiences``): the library appended to the system prompt;
    an empty library leaves the system prompt as it is."""
    if not experiences:
        return system_prompt
    return (system_prompt + "\n\nWhen solving problems, you MUST first carefully read and understand the helpful "
            "instructions and experiences:\n" + format_experiences(experiences))


def format_operations_for_batch(experiences: Mapping[str, str], operations: Sequence[Mapping[str, Any]]) -> str:
    """``_format_exp_and_ops``: each experience with the operations naming its id, then the operations without an id."""
    if not operations:
        return "No batch operations."
    parts = []
    for key, text in experiences.items():
        part = f"Experience {key}:\nContent: {text}\n"
        related = [op for op in operations if op.get("id") == key]
        if related:
            part += "Related Operations:\n" + "\n".join(json.dumps(op, ensure_ascii=False, indent=2) for op in related)
        else:
            part += "No related operations."
        parts.append(part)
    unattached = [op for op in operations if not op.get("id", None)]
    if unattached:
        parts.append("Operations without specific Experience ID:\n"
                     + "\n".join(json.dumps(op, ensure_ascii=False, indent=2) for op in unattached))
    return "\n\n".join(parts)
