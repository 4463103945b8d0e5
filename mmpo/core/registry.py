"""Name -> function registries for the core's pluggable families.

Each family (advantage estimators, policy losses) has a str-Enum of its built-in
names and a decorator that fills a module-level :class:`Registry`. Unknown and
duplicate names fail loudly and list the valid names (the verl ``core_algos``
pattern, without its silent overrides).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions of one family.

    Args:
        family: human-readable family name used in error messages
            (e.g. ``"advantage estimator"``).
    """

    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, F] = {}

    @staticmethod
    def _key(name: str | Enum) -> str:
        if isinstance(name, Enum):
            return str(name.value)
        if not isinstance(name, str):
            raise TypeError(f"registry names must be str or str-Enum, got {type(name).__name__}")
        return name

    def names(self) -> list[str]:
        """Sorted list of registered names."""
        return sorted(self._entries)

    def register(self, name: str | Enum) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; a duplicate name raises ValueError."""
        key = self._key(name)

        def decorator(fn: F) -> F:
            if key in self._entries:
                raise ValueError(
                    f"duplicate {self.family} name {key!r}: already registered to "
                    f"{self._entries[key].__module__}.{self._entries[key].__qualname__}; "
                    f"registered names: {self.names()}"
                )
            self._entries[key] = fn
            return fn

        return decorator

    def unregister(self, name: str | Enum) -> F:
        """Remove and return the function under ``name`` (e.g. a test's or a reloaded plugin's)."""
        fn = self.get(name)
        del self._entries[self._key(name)]
        return fn

    def get(self, name: str | Enum) -> F:
        """Return the function registered under ``name``; unknown names raise ValueError."""
        key = self._key(name)
        try:
            return self._entries[key]
        except KeyError:
            raise ValueError(
                f"unknown {self.family} {key!r}; valid names: {self.names()}"
            ) from None

    def __contains__(self, name: object) -> bool:
        if isinstance(name, (str, Enum)):
            return self._key(name) in self._entries
        return False

    def __len__(self) -> int:
        return len(self._entries)
