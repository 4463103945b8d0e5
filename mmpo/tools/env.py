"""Multi-turn environments: ``reset(row) -> first observation``, ``step(assistant_message) -> StepResult``.

The multi-turn rollout engine (:mod:`mmpo.vlm.multiturn`) keeps one environment per trajectory: it
asks ``reset`` for the user's first message, and after every model turn passes the turn's text to
``step``, which answers with the messages to append (tool or user messages, text), a reward for
that step and whether the episode is over. Tool use is one environment (:class:`ToolEnvironment`);
any object with these methods and a ``tools`` attribute (the JSON schemas the prompt advertises; empty
for an environment without tools) is one too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmpo.tools.functions import Tool
from mmpo.tools.parsing import HermesToolCallParser, MalformedCall, ToolCallParser
from mmpo.tools.sandbox import ToolSandbox

INVALID_CALL_NAME = "invalid"
"""Calls that name no known tool or cannot be parsed are counted as ``tools/invalid/*``."""
MAX_ERROR_CHARS = 200


@dataclass
class StepResult:
    """What an environment answers to one assistant message."""

    observation: list[dict[str, Any]]
    """Chat messages to append before the next model turn (``{"role": "tool" | "user", "content": ...}``): the
    content is a string, or (for a VLM) a list of ``{"type": "image", "image": PIL image}`` and
    ``{"type": "text", "text": str}`` items."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    tools: list[dict[str, Any]]

    def reset(self, row: Mapping[str, Any]) -> str:
        """Start an episode for a dataset row; return the first user message (text)."""

    def step(self, assistant_message: str) -> StepResult:
        """React to the model's turn."""


class ToolStats:
    """Counts per tool: ``calls``, ``errors`` (malformed, raised, oversized, sandbox failures) and ``timeouts``."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "errors": 0, "timeouts": 0})

    def add(self, name: str, *, error: bool = False, timeout: bool = False) -> None:
        entry = self.counts[name]
        entry["calls"] += 1
        entry["errors"] += int(error or timeout)
        entry["timeouts"] += int(timeout)

    def metrics(self) -> dict[str, float]:
        """``tools/<name>/calls``, ``tools/<name>/errors``, ``tools/<name>/timeouts``."""
        return {f"tools/{name}/{key}": float(value) for name, entry in sorted(self.counts.items())
                for key, value in entry.items()}

    def reset(self) -> None:
        self.counts.clear()


def _error(text: str) -> str:
    text = " ".join(text.split())
    return "Error: " + (text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "...")


class ToolEnvironment:
    """Tool use as an environment: a message with tool calls gets their results as ``tool`` messages (in
    call order); a message without one ends the episode. Calls run in the sandbox; a malformed call (bad
    JSON, an unknown tool, wrong arguments), a raising tool, a timeout or an oversized output is a short
    ``Error: ...`` message to the model and a count in ``stats``, never an exception.

    An image tool (``image_zoom_in_tool``, :mod:`mmpo.tools.image_zoom`) runs here, in the trainer's process, on
    the row's images (kept by :meth:`reset`): its answer is a ``tool`` message holding the new image."""

    def __init__(self, tools: Sequence[Tool], sandbox: ToolSandbox, *, parser: ToolCallParser | None = None,
                 stats: ToolStats | None = None, max_calls_per_turn: int = 4) -> None:
        self.tool_by_name = {tool.name: tool for tool in tools}
        self.tools = [tool.schema for tool in tools]
        self.sandbox = sandbox
        self.parser = parser or HermesToolCallParser()
        self.stats = stats if stats is not None else ToolStats()
        self.max_calls_per_turn = max_calls_per_turn
        self.images: list[Any] = []

    def reset(self, row: Mapping[str, Any]) -> str:
        self.images = list(row.get("images") or [])
        return str(row["problem"])

    def step(self, assistant_message: str) -> StepResult:
        return self.step_batch([self], [assistant_message])[0]

    @staticmethod
    def step_batch(envs: Sequence["ToolEnvironment"], messages: Sequence[str]) -> list[StepResult]:
        """:meth:`step` for several environments at once: every valid call of every message goes to the sandbox
        in one batch (run in parallel there). Environments that share a sandbox share its batch."""
        replies: list[list[Any]] = []  # per env: content per call (text, or image items); None = waiting for the sandbox
        names: list[list[str]] = []
        batches: dict[int, list[tuple[int, int, Tool, dict]]] = defaultdict(list)
        sandboxes: dict[int, ToolSandbox] = {}
        results: list[StepResult] = []
        for env_index, (env, message) in enumerate(zip(envs, messages)):
            calls = env.parser.parse(message)
            texts: list[Any] = []
            call_names: list[str] = []
            for call_index, call in enumerate(calls):
                name = call.name if not isinstance(call, MalformedCall) else INVALID_CALL_NAME
                if isinstance(call, MalformedCall):
                    texts.append(_error(call.error))
                    env.stats.add(INVALID_CALL_NAME, error=True)
                elif call_index >= env.max_calls_per_turn:
                    texts.append(_error(f"at most {env.max_calls_per_turn} tool calls per turn"))
                    env.stats.add(call.name if call.name in env.tool_by_name else INVALID_CALL_NAME, error=True)
                elif call.name not in env.tool_by_name:
                    texts.append(_error(f"unknown tool {call.name!r}; available: {sorted(env.tool_by_name)}"))
                    env.stats.add(INVALID_CALL_NAME, error=True)
                    name = INVALID_CALL_NAME
                else:
                    tool = env.tool_by_name[call.name]
                    problem = tool.check_arguments(call.arguments)
                    if problem is not None:
                        texts.append(_error(problem))
                        env.stats.add(tool.name, error=True)
                    elif tool.image_runner is not None:
                        try:
                            image = tool.image_runner(env.images, **call.arguments)
                        except Exception as exc:  # a raising image tool is an error message, never a dead run
                            texts.append(_error(str(exc)))
                            env.stats.add(tool.name, error=True)
                        else:
                            texts.append([{"type": "image", "image": image}])
                            env.stats.add(tool.name)
                    else:
                        texts.append(None)
                        batches[id(env.sandbox)].append((env_index, call_index, tool, call.arguments))
                        sandboxes[id(env.sandbox)] = env.sandbox
                call_names.append(name)
            replies.append(texts)
            names.append(call_names)
        for key, batch in batches.items():
            outcomes = sandboxes[key].run([(tool.spec, arguments) for _, _, tool, arguments in batch])
            for (env_index, call_index, tool, _), outcome in zip(batch, outcomes):
                envs[env_index].stats.add(tool.name, error=outcome.status == "error", timeout=outcome.status == "timeout")
                replies[env_index][call_index] = outcome.text if outcome.ok else _error(outcome.text)
        for texts, call_names in zip(replies, names):
            observation = [{"role": "tool", "name": name, "content": text} for name, text in zip(call_names, texts)]
            results.append(StepResult(observation, reward=0.0, done=not observation,
                                      info={"tool_calls": len(observation)}))
        return results
