"""Tools as plain Python functions (TRL's ``tools=[fn]`` convention).

A tool is a function with type hints and a Google-style docstring (a summary line and an ``Args:``
section describing every parameter); its JSON schema, which the chat template shows the model, comes
from the signature through ``transformers.utils.get_json_schema``. A config names a tool as

- a built-in name (:data:`BUILTIN_TOOLS`: ``calculator``, ``python``, ``image_zoom_in_tool``, ``codebook``), or
- ``path/to/file.py:function`` / ``package.module:function`` (the same loader as user reward functions,
  :mod:`mmpo.plugins`).

:func:`load_tools` imports each, builds its schema and checks it (before the model loads); the model
calls a tool by its function's ``__name__``. The tool runs in the sandbox worker
(:mod:`mmpo.tools.sandbox`), which loads it again by its canonical spec (:func:`load_tool_function`); an image
tool (:mod:`mmpo.tools.image_zoom`) runs in the environment on the episode's images instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmpo.plugins import PluginSpecError, is_plugin_spec, load_function, parse_spec

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "mmpo.tools.calculator:calculator",
    "python": "mmpo.tools.python_exec:python",
    "image_zoom_in_tool": "mmpo.tools.image_zoom:image_zoom_in_tool",
    "codebook": "mmpo.tools.codebook:codebook",
}
"""Built-in tool name -> its ``module:function`` spec."""


class ToolSpecError(ValueError):
    """A tool setting that names no usable tool."""


def canonical_tool_spec(name_or_spec: str) -> str:
    """A built-in name's spec, or the user spec with an absolute file path (the same from any directory)."""
    if name_or_spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name_or_spec]
    if not is_plugin_spec(name_or_spec):
        raise ToolSpecError(f"unknown tool {name_or_spec!r}; built-in: {sorted(BUILTIN_TOOLS)}; a function of your "
                            "own is given as 'path/to/file.py:function' or 'package.module:function'")
    try:
        return parse_spec(name_or_spec, "tool").canonical
    except PluginSpecError as exc:
        raise ToolSpecError(str(exc)) from None


def load_tool_function(name_or_spec: str) -> Callable:
    """The function a tool setting names (loaded once per process)."""
    spec = canonical_tool_spec(name_or_spec)
    try:
        return load_function(parse_spec(spec, "tool"))
    except PluginSpecError as exc:
        raise ToolSpecError(str(exc).replace(repr(spec), repr(name_or_spec))) from None


@dataclass(frozen=True)
class Tool:
    """A loaded tool: the name the model calls it by, its spec for the sandbox, its JSON schema and function."""

    name: str
    spec: str
    schema: dict[str, Any]
    function: Callable

    @property
    def image_runner(self) -> Callable | None:
        """``run(images, **arguments) -> PIL image`` of an image tool (:mod:`mmpo.tools.image_zoom`), else None."""
        from mmpo.tools.image_zoom import image_tool_runner

        return image_tool_runner(self.function)

    def check_arguments(self, arguments: Any) -> str | None:
        """Why ``arguments`` cannot be passed to the tool (a short message for the model), or None."""
        if not isinstance(arguments, Mapping):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as exc:
            return f"wrong arguments for {self.name}: {exc}"
        properties = self.schema["function"]["parameters"].get("properties", {})
        json_types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
                      "object": dict}
        for key, value in arguments.items():
            expected = json_types.get(properties.get(key, {}).get("type"))
            if expected is not None and (not isinstance(value, expected) or (
                    isinstance(value, bool) and expected is not bool)):
                return f"argument {key!r} of {self.name} must be {properties[key]['type']}, got {type(value).__name__}"
        return None


def tool_schema(function: Callable, setting: str = "tool") -> dict[str, Any]:
    """The function's JSON schema (``{"type": "function", "function": {...}}``) from its type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ToolSpecError(f"{setting}: cannot build a JSON schema for {getattr(function, '__name__', function)!r}: "
                            f"{exc} (a tool needs type hints on every parameter and a docstring with an Args: "
                            "section describing each)") from None


def load_tools(names: Sequence[str], setting: str = "tools") -> list[Tool]:
    """Load, check and describe the tools of a config: each importable, with a schema, and named uniquely.

    Raises:
        ToolSpecError: naming ``setting``, the tool and the problem.
    """
    tools: list[Tool] = []
    for name in names:
        if not isinstance(name, str):
            raise ToolSpecError(f"{setting}: a tool is a name or 'file.py:function', got {name!r}")
        try:
            function = load_tool_function(name)
        except ToolSpecError as exc:
            raise ToolSpecError(f"{setting}: {exc}") from None
        schema = tool_schema(function, f"{setting}: tool {name!r}")
        tool_name = schema["function"]["name"]
        if any(t.name == tool_name for t in tools):
            raise ToolSpecError(f"{setting}: two tools are named {tool_name!r}; give the functions distinct names")
        tools.append(Tool(tool_name, canonical_tool_spec(name), schema, function))
    return tools


def tool_system_prompt(system_prompt: str | None, schemas: Sequence[Mapping[str, Any]]) -> str | None:
    """The system prompt followed by the tool block in Qwen2.5's wording (the text its chat template renders
    from ``tools=``): the tools' JSON schemas inside ``<tools></tools>`` and the ``<tool_call>`` call format.
    Written into the system prompt, so every chat template (the tiny models' included) shows it the same
    way. Without tools: the system prompt unchanged."""
    import json

    if not schemas:
        return system_prompt
    lines = [system_prompt or "", "", "# Tools", "", "You may call one or more functions to assist with the user query.",
             "", "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    lines += [json.dumps(schema) for schema in schemas]
    lines += ["</tools>", "", "For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:", "<tool_call>",
              '{"name": <function-name>, "arguments": <args-json-object>}', "</tool_call>"]
    return "\n".join(lines).lstrip("\n")
