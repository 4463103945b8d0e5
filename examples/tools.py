"""A user tool for docs/agents.md: a plain typed function with a docstring (TRL's ``tools=[fn]`` convention).

Name it in a config as ``examples/tools.py:unit_price`` (from the repository root).
"""


def unit_price(total_cents: int, count: int) -> str:
    """Price of one item when `count` items cost `total_cents` together, in cents (rounded down).

    Args:
        total_cents: what all the items cost together, in cents.
        count: how many items there are.
    """
    if count <= 0:
        raise ValueError("count must be positive")
    return str(total_cents // count)
