"""A lookup tool over a small synthetic world, with noisy output: the testbed of MATPO (docs/matpo.md).

Two kinds of record: ``person:<name>`` (the city the person lives in) and ``city:<name>`` (its population). Both
are functions of the name (a hash), so the tool needs no state and the ``twohop`` task
(:mod:`mmpo.data.synthetic.agent_tasks`) knows every answer. Each answer is padded with distractor records (other
people and cities) before and after the one asked for, so a model that reads tool output under a small context
budget pays for every call; a worker that reads it and returns a one-line summary does not.
"""

from __future__ import annotations

import hashlib

CITIES = ("Avalon", "Brindle", "Corvale", "Dunmore", "Elsworth", "Fairhaven", "Glenrock", "Harrow", "Islington",
          "Juniper")
"""The world's cities."""
DISTRACTORS = 6
"""Distractor records around the one asked for."""


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def city_of(person: str) -> str:
    """The city a person lives in."""
    return CITIES[_digest("person:" + person.strip().lower()) % len(CITIES)]


def population_of(city: str) -> int:
    """A city's population (10 000 to 99 999)."""
    return 10_000 + _digest("city:" + city.strip().lower()) % 90_000


def _record(kind: str, name: str) -> str:
    if kind == "person":
        return f"{name} lives in {city_of(name)}."
    return f"{name} has {population_of(name)} inhabitants."


def lookup(key: str) -> str:
    """Look up a record: "person:<name>" gives the city the person lives in, "city:<name>" the city's population.

    Args:
        key: "person:<full name>" or "city:<city name>".
    """
    kind, _, name = key.partition(":")
    kind, name = kind.strip().lower(), name.strip()
    if kind not in ("person", "city") or not name:
        raise ValueError('key must be "person:<name>" or "city:<name>"')
    if kind == "city" and name.lower() not in {c.lower() for c in CITIES}:
        raise ValueError(f"no city named {name!r}")
    seed = _digest(key)
    others = [f"{'person' if i % 2 else 'city'}" for i in range(DISTRACTORS)]
    noise = [_record("person", f"Person {(seed >> i) % 997}") if kind_ == "person"
             else _record("city", CITIES[(seed >> (2 * i)) % len(CITIES)]) for i, kind_ in enumerate(others)]
    half = DISTRACTORS // 2
    return " ".join([*noise[:half], f"[match] {_record(kind, name)}", *noise[half:]])
