"""Tools that misbehave on purpose, for the sandbox tests (loaded by path: tests/tools/misbehaving_tools.py:fn)."""

import os
import time


def hang(seconds: float) -> str:
    """Sleep far past any deadline.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def fork_sleeper() -> str:
    """Fork a child that sleeps forever and return its pid.

    """
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    return str(pid)


def allocate_forever() -> str:
    """Allocate memory without bound."""
    blocks = []
    while True:
        blocks.append(bytearray(64 * 2**20))


def write_outside(path: str) -> str:
    """Write a file at an absolute path.

    Args:
        path: where to write.
    """
    with open(path, "w") as handle:
        handle.write("escaped")
    return "written"


def write_inside() -> str:
    """Write a file in the working directory and return the directory."""
    with open("note.txt", "w") as handle:
        handle.write("fine")
    return os.getcwd()


def print_megabytes() -> str:
    """Print 5 MB to stdout and return a short text."""
    print("x" * (5 * 2**20))
    return "printed"


def huge_result() -> str:
    """Return 1 MB of text."""
    return "y" * 2**20


def explode(message: str) -> str:
    """Raise an error.

    Args:
        message: the error message.
    """
    raise RuntimeError(message)


def open_socket() -> str:
    """Try to reach the network."""
    import socket

    socket.create_connection(("127.0.0.1", 9))
    return "connected"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def untyped(value):
    """A parameter without a type hint (no JSON schema can be built).

    Args:
        value: anything.
    """
    return value
