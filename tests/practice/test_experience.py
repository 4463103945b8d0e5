"""Training-Free GRPO's library operations on fixed extractor outputs (hand values), with a parity test against
the official application loop of TencentCloudADP/youtu-agent utu/practice/experience_updater.py."""

from __future__ import annotations

import copy
import json
import re

import pytest

from mmpo.practice.experience import (
    OperationFormatError,
    apply_operations,
    extract_experiences,
    format_experiences,
    format_operations_for_batch,
    parse_operations,
    partially_correct,
    problem_with_experiences,
    system_with_experiences,
)


def official_apply(experiences, revision_plan):
    """Transcribed from youtu-agent utu/practice/experience_updater.py ExperienceUpdater._batch_update (the loop
    applying ``revision_plan``) followed by ExperienceUpdater.run's renumbering to G{i}."""
    max_ID = len(experiences)
    new_experiences = copy.deepcopy(experiences)
    for plan in revision_plan:
        operation = plan.get("operation", "ADD")
        content = plan.get("content", "")
        target_id = plan.get("id", None)
        if not content:
            continue
        if operation == "ADD":
            new_experiences[f"{max_ID}"] = content
            max_ID += 1
        elif operation == "UPDATE":
            if target_id in new_experiences:
                new_experiences[target_id] = content
            else:
                new_experiences[f"{max_ID}"] = content
                max_ID += 1
        elif operation == "DELETE":
            if target_id in new_experiences:
                del new_experiences[target_id]
    return {f"G{i}": exp for i, exp in enumerate(new_experiences.values())}


LIBRARY = {"G0": "Units: check units.", "G1": "Signs: track minus signs.", "G2": "Order: multiply first."}
# a batch-update answer as a model writes it: prose, then the fenced JSON
ANSWER = """Merging the proposals.
```json
[
  {"operation": "UPDATE", "id": "G1", "content": "Signs: track minus signs through every subtraction."},
  {"operation": "DELETE", "id": "G0", "content": "Units: obsolete."},
  {"operation": "ADD", "id": null, "content": "Checks: substitute the answer back."},
  {"operation": "NONE", "id": null, "content": "Order: multiply first."},
  {"operation": "UPDATE", "id": "G9", "content": "Carry: write carries down."},
  {"operation": "DELETE", "id": "G7", "content": "Ghost: not there."},
  {"operation": "ADD", "content": ""},
  {"content": "Default: an operation-less entry is an ADD."}
]
```
done."""


def test_parse_and_apply_by_hand():
    ops = parse_operations(ANSWER)
    assert len(ops) == 8 and ops[0] == {"operation": "UPDATE", "id": "G1",
                                        "content": "Signs: track minus signs through every subtraction."}
    new = apply_operations(LIBRARY, ops)
    # G0 deleted; G1 updated in place; G2 kept; ADD -> id "3"; UPDATE of unknown G9 -> "4"; DELETE of G7 ignored;
    # the empty ADD skipped; the operation-less entry -> "5"; then renumbered in insertion order
    assert new == {"G0": "Signs: track minus signs through every subtraction.", "G1": "Order: multiply first.",
                   "G2": "Checks: substitute the answer back.", "G3": "Carry: write carries down.",
                   "G4": "Default: an operation-less entry is an ADD."}
    assert LIBRARY["G0"] == "Units: check units."  # the input is not changed
    assert new == official_apply(LIBRARY, ops)


@pytest.mark.parametrize("library", [{}, LIBRARY, {"G0": "a: b."}])
def test_apply_matches_the_official_loop(library):
    ops = [{"operation": "ADD", "content": "x: 1."}, {"operation": "DELETE", "id": "G0", "content": "y"},
           {"operation": "UPDATE", "id": "G2", "content": "z: 2."}, {"operation": "ADD", "content": "w: 3."},
           {"operation": "UPDATE", "id": "3", "content": "x: 1 again."}]
    assert apply_operations(library, ops) == official_apply(library, ops)


def test_added_ids_count_from_the_size_before_the_batch():
    # {} + ADD a (id "0") + ADD b ("1") + UPDATE "0" (a -> c) -> {"0": c, "1": b} -> G0 = c, G1 = b
    ops = [{"operation": "ADD", "content": "a"}, {"operation": "ADD", "content": "b"},
           {"operation": "UPDATE", "id": "0", "content": "c"}]
    assert apply_operations({}, ops) == {"G0": "c", "G1": "b"}


def test_parse_rejects_unreadable_answers():
    with pytest.raises(OperationFormatError, match="not valid JSON"):
        parse_operations("```json\n[{\"operation\": \"ADD\", // comment\n}]\n```")
    with pytest.raises(OperationFormatError, match="JSON array of objects"):
        parse_operations('```json\n{"operation": "ADD"}\n```')
    with pytest.raises(OperationFormatError, match="unknown operation 'MERGE'"):
        parse_operations('[{"operation": "MERGE", "content": "a"}]')
    assert parse_operations('[{"operation": "NONE", "id": null, "content": "a"}]')[0]["operation"] == "NONE"


def test_extract_experiences_matches_the_official_regex():
    text = "<Performance Assessment>x</Performance Assessment>\n<experiences>\n  1. A: b.\n  2. C: d.\n</EXPERIENCES>"
    assert extract_experiences(text) == "1. A: b.\n  2. C: d."
    official = re.compile(r"<Experiences>\s*(.*?)\s*</Experiences>", re.DOTALL | re.IGNORECASE).search(text)
    assert extract_experiences(text) == official.group(1).strip()
    assert extract_experiences("no tags here") == ""


@pytest.mark.parametrize("rewards, kept", [([0, 0, 0, 0, 0], False), ([1, 1, 1, 1, 1], False),
                                           ([1, 0, 0, 0, 0], True), ([0.5], True), ([1, 1, 1, 1, 0], True), ([], False)])
def test_only_partially_correct_groups_are_kept(rewards, kept):
    assert partially_correct(rewards) is kept


def test_prompt_text():
    assert format_experiences({}) == "None"
    assert format_experiences({"G0": "a", "G1": "b"}) == "[G0]. a\n[G1]. b"
    assert problem_with_experiences("1+1?", {"G0": "a"}) == (
        "Please solve the problem:\n1+1?\n\nWhen solving problems, you MUST first carefully read and understand "
        "the helpful instructions and experiences:\n[G0]. a")
    assert system_with_experiences("Be brief.", {}) == "Be brief."
    assert system_with_experiences("Be brief.", {"G0": "a"}).endswith("experiences:\n[G0]. a")


def test_batch_listing_groups_operations_by_id():
    ops = [{"operation": "UPDATE", "id": "G1", "content": "u"}, {"operation": "ADD", "id": None, "content": "n"}]
    listing = format_operations_for_batch({"G0": "a", "G1": "b"}, ops)
    assert listing == ("Experience G0:\nContent: a\nNo related operations.\n\nExperience G1:\nContent: b\n"
                       "Related Operations:\n" + json.dumps(ops[0], indent=2) + "\n\nOperations without specific "
                       "Experience ID:\n" + json.dumps(ops[1], indent=2))
    assert format_operations_for_batch({"G0": "a"}, []) == "No batch operations."
