"""A reward for the loop tests: 1 for a completion of even length, else 0 (mixed groups from a random tiny model)."""


def parity(completions, **columns):
    return [float(len(text) % 2 == 0) for text in completions]
