"""Tool calls in model text: the Qwen / Hermes format, and a pluggable parser interface.

Qwen2.5 / Qwen3 chat templates (with ``tools=``) ask for each call as
``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>``.
:class:`HermesToolCallParser` finds every such block; each becomes a :class:`ToolCall` or, when it
cannot be one (bad JSON, no name, arguments that are not an object, an unclosed tag), a
:class:`MalformedCall` whose ``error`` is shown to the model. A parser of your own is any object with
``parse(text) -> list[ToolCall | MalformedCall]`` (named in a config as ``file.py:factory`` /
``module:factory``, a callable returning it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Union


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    """A call the parser could not read; ``error`` is a short message for the model."""

    error: str
    text: str = ""


ParsedCall = Union[ToolCall, MalformedCall]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ParsedCall]:
        """Every tool call in an assistant message, in order (empty: the message answers without a call)."""


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 / Qwen3 / Hermes)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        position = 0
        while True:
            start = text.find(self.open_tag, position)
            if start < 0:
                return calls
            end = text.find(self.close_tag, start)
            if end < 0:
                calls.append(MalformedCall(f"{self.open_tag} without {self.close_tag}", text[start:start + 200]))
                return calls
            body = text[start + len(self.open_tag):end]
            calls.append(self._call(body))
            position = end + len(self.close_tag)

    @staticmethod
    def _call(body: str) -> ParsedCall:
        try:
            value = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return MalformedCall(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})", body[:200])
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return MalformedCall('a tool call is a JSON object {"name": ..., "arguments": {...}}', body[:200])
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return MalformedCall("the tool call's arguments are not a JSON object", body[:200])
        if not isinstance(arguments, dict):
            return MalformedCall("the tool call's arguments are not a JSON object", body[:200])
        return ToolCall(value["name"], arguments)


PARSERS = {"hermes": HermesToolCallParser}
"""Built-in parsers by name."""


def make_parser(name: str) -> ToolCallParser:
    """A built-in parser by name, or the object a ``file.py:factory`` / ``module:factory`` spec returns."""
    if name in PARSERS:
        return PARSERS[name]()
    from mmpo.plugins import is_plugin_spec, load_function, parse_spec

    if not is_plugin_spec(name):
        raise ValueError(f"unknown tool-call parser {name!r}; built-in: {sorted(PARSERS)}, or 'file.py:factory'")
    parser = load_function(parse_spec(name, "tool-call parser"))()
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"tool-call parser {name!r}: the factory returned {type(parser).__name__}, which has no "
                         "parse(text) method")
    return parser
