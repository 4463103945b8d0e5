"""One-line config errors for ``mmpo fit|validate|test|predict``.

jsonargparse (under LightningCLI) reports a bad value as a nested "Does not validate against
any of the Union subtypes" text that ends with "Expected a <class 'NoneType'>" and a dump of
the whole Namespace, and a ValueError raised by a module's constructor comes out wrapped the
same way under a long traceback. :class:`ConfigErrorsMixin` turns both into one final line
that names the key and the bad value (or the class and its message), with exit code 2 like
any argparse error. A ``class_path`` whose package needs an extra that is not installed
(``mmpo.robotics`` without ``mmpo[robotics]``) ends in that extra's one line (mmpo/_extras.py).
``JSONARGPARSE_DEBUG=1`` keeps jsonargparse's full report and tracebacks.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, NoReturn

from jsonargparse import ArgumentError

from mmpo._extras import MissingExtraError, find_missing_extra

# Constructor errors that are the user's input (bad setting, missing file): one line, exit 2.
# Anything else keeps its traceback (it is more likely a bug than a config mistake).
CONFIG_ERROR_TYPES: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)

_PARSER_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":$')
_PARSER_KEY_INLINE = re.compile(r'^Parser key "(?P<key>[^"]+)": (?P<cause>.+)$')
_CLASS_PATH = re.compile(r"^- Problem with given class_path '(?P<cls>[^']+)':$")
_EXPECTED_GOT = re.compile(r"^-? ?Expected a <class '(?P<type>[\w.]+)'>\. Got value: (?P<value>.*)$")
_EXPECTED = re.compile(r"^- Expected a <class '(?P<type>[\w.]+)'>$")
_REQUIRED = re.compile(r"^the following arguments are required: (?P<names>.+)$")
_NOT_ACCEPTED = re.compile(r"^Option '(?P<name>[^']+)' is not accepted$")
_GIVEN_VALUE = re.compile(r"^Given value: (?P<value>.*)$")
_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
          "- Expected a <class 'NoneType'>")

_TYPE_WORDS = {"float": "a float", "int": "an int", "str": "a string", "bool": "true or false", "dict": "a mapping",
               "list": "a list", "tuple": "a list"}


def fail(subcommand: str | None, message: str) -> NoReturn:
    """Print ``mmpo <subcommand>: error: <message>`` as the last line on stderr and exit with code 2."""
    prefix = f"mmpo {subcommand}" if subcommand else "mmpo"
    one_line = " ".join(message.split())
    sys.stderr.flush()
    sys.stderr.write(f"{prefix}: error: {one_line}\n")
    raise SystemExit(2)


def _type_words(names: list[str]) -> str:
    words = [_TYPE_WORDS.get(name, f"a {name}") for name in names if name != "NoneType"]
    text = " or ".join(dict.fromkeys(words)) or "valid"
    return text + (" (or null)" if "NoneType" in names else "")


def _shown(value: str) -> str:
    value = value.strip()
    return value if value.startswith(("'", '"', "[", "{")) else repr(value)


def describe_parse_error(message: str) -> str:
    """The cause of a jsonargparse error as ``key: what is wrong`` (one line).

    The message nests ``Parser key "k":`` and ``- Problem with given class_path 'C':`` blocks
    by indentation; the first leaf that is not the "or None" alternative is the cause, and
    the blocks above it give its full key (``model.init_args.optim.lr``), as typed on the command line.
    """
    lines = [(len(raw) - len(raw.lstrip()), raw.strip()) for raw in message.splitlines() if raw.strip()]
    stack: list[tuple[int, str]] = []  # (indent, key fragment)

    def key_at(indent: int, leaf: str | None = None) -> str:
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parts = [fragment for _, fragment in stack] + ([leaf] if leaf else [])
        return ".".join(parts) or "config"

    for index, (indent, text) in enumerate(lines):
        if match := _PARSER_KEY.match(text):
            key_at(indent)
            stack.append((indent, match["key"]))
        elif match := _PARSER_KEY_INLINE.match(text):
            return f"{key_at(indent, match['key'])}: {match['cause']}"
        elif match := _CLASS_PATH.match(text):
            key_at(indent)
            stack.append((indent, "init_args"))
            child = lines[index + 1] if index + 1 < len(lines) else None
            if child and child[0] > indent and not (
                _PARSER_KEY.match(child[1]) or _REQUIRED.match(child[1]) or _NOT_ACCEPTED.match(child[1])
            ):
                key = key_at(indent)
                return f"{key}: cannot use class_path '{match['cls']}': {child[1]}"
        elif match := _EXPECTED_GOT.match(text):
            if match["type"] != "NoneType":
                return f"{key_at(indent)}: {_shown(match['value'])} is not {_type_words([match['type']])}"
        elif match := _REQUIRED.match(text):
            names = [name.strip() for name in match["names"].split(",")]
            return f"{key_at(indent, names[0])}: required but missing or null" + (
                f" (also required: {', '.join(names[1:])})" if names[1:] else "")
        elif match := _NOT_ACCEPTED.match(text):
            return f"{key_at(indent, match['name'])}: unknown option"
        elif text.startswith("Does not validate against any of the Union subtypes") and stack:
            # a union-typed value (``int | None``): list the accepted types and the given value
            block = [t for i, t in lines[index + 1:] if i >= indent]
            expected = [m["type"] for t in block if (m := _EXPECTED.match(t))]
            given = next((m["value"] for t in block if (m := _GIVEN_VALUE.match(t))), None)
            if expected and given is not None and stack[-1][1] != "init_args" and all(
                not _CLASS_PATH.match(t) for t in block
            ):
                return f"{key_at(indent)}: {_shown(given)} is not {_type_words(expected)}"
    cause = next((text for _, text in lines if not text.startswith(_NOISE)), message.strip())
    return cause.lstrip("- ")


def constructor_error(exc: BaseException) -> BaseException:
    """The exception a constructor raised, unwrapped from jsonargparse's instantiation errors."""
    current: BaseException | None = exc
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if not _raised_in_jsonargparse(current):
            return current
        current = current.__cause__ or current.__context__
    return exc


def _raised_in_jsonargparse(exc: BaseException) -> bool:
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}jsonargparse{os.sep}" in tb.tb_frame.f_code.co_filename


def _debug() -> bool:
    return bool(os.environ.get("JSONARGPARSE_DEBUG"))


class ConfigErrorsMixin:
    """LightningCLI mixin: config mistakes end in one ``mmpo <cmd>: error: ...`` line, exit code 2."""

    config: Any
    parser: Any

    def parse_arguments(self, parser: Any, args: Any) -> None:
        subcommand = _subcommand_of(args, getattr(self, "_subcommand_parsers", {}))
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        for each in parsers:
            each.exit_on_error = _debug()  # raise ArgumentError instead of printing usage + the nested report
        try:
            super().parse_arguments(parser, args)  # type: ignore[misc]
        except ArgumentError as exc:
            missing = find_missing_extra(exc)  # jsonargparse imports a class_path; the import's error is chained
            if missing is not None and not _debug():
                fail(subcommand, str(missing))  # a class_path in a package whose extra is not installed
            cause = describe_parse_error(str(exc))
            if subcommand and cause.startswith(f"{subcommand}."):
                cause = cause[len(subcommand) + 1:]  # keys as typed: "data", not "fit.data"
            fail(subcommand, cause)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()  # type: ignore[misc]
            return
        except Exception as exc:  # noqa: BLE001 - sorted below: config mistakes vs everything else
            failure = exc
        cause = constructor_error(failure)
        if isinstance(cause, MissingExtraError) and not _debug():
            fail(self.config.get("subcommand"), str(cause))
        if _debug() or not isinstance(cause, CONFIG_ERROR_TYPES):
            raise cause  # outside the except block: its own traceback, without the wrapper's Namespace dump
        fail(self.config.get("subcommand"), f"{self._owner_of(failure)}: {cause}")

    def _owner_of(self, failure: BaseException) -> str:
        """``model (class_path)`` / ``data (class_path)`` for the class whose constructor failed."""
        match = re.search(r"class_path='([^']+)'", str(failure))
        if match is None:
            return type(failure).__name__
        class_path = match[1]
        section = self.config.get(self.config.get("subcommand") or "", self.config)
        for key in ("model", "data", "trainer"):
            value = section.get(key) if hasattr(section, "get") else None
            if value is not None and getattr(value, "class_path", None) == class_path:
                return f"{key} ({class_path})"
        return class_path


def _subcommand_of(args: Any, subcommands: dict[str, Any]) -> str | None:
    if isinstance(args, (list, tuple)):
        return next((a for a in args if isinstance(a, str) and a in subcommands), None)
    return None
