"""A generative judge as a reward: ``judge:FILE.yaml`` in ``rewards.weights``.

The YAML file describes the judge (:class:`JudgeConfig`): a rubric prompt (a Python format string over the row's
``problem``, ``answer`` and the ``completion``), a pattern that reads the score from the judge's reply, and a
backend: ``openai`` (an OpenAI-compatible ``/chat/completions`` endpoint: a vLLM or SGLang server) or ``local``
(a causal LM or VLM checkpoint loaded once in the training process; a VLM judge also sees the row's images).

An unparseable reply, or a request that failed after its retries or missed its deadline, scores ``None`` (not
applicable: that completion's total leaves the judge out, as for a user function's ``None``) and is counted
(``rewards/<label>/none_frac``, ``judge/<label>/failed``, ``judge/<label>/unparsed``); a judge never crashes or
hangs the run. Replies are cached by prompt text (a repeated completion is judged once).

The HTTP client is the standard library's (``urllib``): a POST with a JSON body and a per-request timeout is all
it needs, and an extra dependency for that would have to be installed by every user.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

JUDGE_PREFIX = "judge:"


def is_judge_spec(name: str) -> bool:
    return name.startswith(JUDGE_PREFIX)


@dataclass(frozen=True)
class JudgeConfig:
    """A generative judge (the fields of its YAML file).

    Attributes:
        backend: ``openai`` (an OpenAI-compatible endpoint at ``url``) or ``local`` (the checkpoint at ``model``).
        model: the model name sent to the endpoint, or the local checkpoint's path.
        rubric: the judge's prompt, a format string over ``{problem}``, ``{answer}`` and ``{completion}``.
        score_pattern: a regular expression whose first group is the score in the reply (the last match counts).
        scale: the score is divided by this (a 0-10 rubric with scale 10 gives rewards in [0, 1]).
        url: the endpoint's base URL (``.../v1``), for ``openai``.
        max_tokens: the longest reply.
        temperature: sampling temperature of the judge (0: greedy).
        timeout_s: deadline of one request.
        retries: further attempts after a failed request (connection error, HTTP 429 / 5xx, timeout).
        backoff_s: wait before the first retry, doubled at each further one.
        concurrency: most requests in flight at once.
        cache: keep replies by prompt text for the run.
        name: the label of its ``rewards/<label>/*`` metrics (default: the YAML file's name).
    """

    backend: str
    model: str
    rubric: str
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    scale: float = 1.0
    url: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    timeout_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.5
    concurrency: int = 4
    cache: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        def check(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(f"judge: {message}")

        check(self.backend in ("openai", "local"), f"backend must be 'openai' or 'local', got {self.backend!r}")
        check(self.backend != "openai" or bool(self.url), "backend 'openai' needs a url (e.g. http://host:8000/v1)")
        check("{completion}" in self.rubric, "the rubric must contain {completion}")
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as exc:
            raise ValueError(f"judge: score_pattern is not a regular expression: {exc}") from None
        check(pattern.groups >= 1, "score_pattern needs a group around the score")
        check(self.scale > 0, f"scale must be > 0, got {self.scale}")
        check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        check(self.retries >= 0 and self.backoff_s >= 0, "retries and backoff_s must be >= 0")
        check(self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}")


def load_judge_config(path: str | Path) -> JudgeConfig:
    """Read and check a judge YAML file (unknown keys are an error naming them)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"judge: no judge file at {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"judge: {path} must hold a mapping of settings")
    known = set(JudgeConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"judge: {path}: unknown setting(s) {unknown}; valid: {sorted(known)}")
    data.setdefault("name", path.stem)
    return JudgeConfig(**data)


def parse_score(reply: str, pattern: str, scale: float) -> float | None:
    """The last match of ``pattern`` in ``reply`` divided by ``scale``; None when there is none."""
    matches = re.findall(pattern, reply)
    if not matches:
        return None
    last = matches[-1]
    try:
        return float(last[0] if isinstance(last, tuple) else last) / scale
    except ValueError:
        return None


class OpenAIChatBackend:
    """POST ``{url}/chat/completions`` with one user message; retries with exponential backoff."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.endpoint = config.url.rstrip("/") + "/chat/completions"

    def reply(self, prompt: str) -> str:
        config = self.config
        body = json.dumps({"model": config.model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": config.max_tokens, "temperature": config.temperature}).encode()
        delay = config.backoff_s
        for attempt in range(config.retries + 1):
            request = urllib.request.Request(self.endpoint, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as exc:
                if exc.code not in (408, 429) and exc.code < 500 or attempt == config.retries:
                    raise
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
                if attempt == config.retries:
                    raise
            time.sleep(delay)
            delay *= 2
        raise RuntimeError("unreachable")


class LocalBackend:
    """A local causal LM or VLM (``mmpo.vlm.factory.load_vlm``), greedy or sampled, loaded on first use."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self._engine: Any = None
        self._lock = threading.Lock()

    def replies(self, prompts: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
        import torch

        with self._lock:
            if self._engine is None:
                from mmpo.vlm.factory import load_vlm
                from mmpo.vlm.rollout import HFGenerateEngine

                model, processor = load_vlm(self.config.model)
                self._engine = HFGenerateEngine(model.eval(), processor, system_prompt=None)
            judged = [{"problem": prompt, "images": list(row.get("images") or [])} for prompt, row in zip(prompts, rows)]
            with torch.no_grad():
                return self._engine.generate(judged, num_samples=1, max_new_tokens=self.config.max_tokens,
                                             do_sample=self.config.temperature > 0,
                                             temperature=max(self.config.temperature, 1e-5)).texts


@dataclass
class JudgeCounts:
    """What the judge did this run: requests made, served from the cache, failed, unparsed."""

    requests: int = 0
    cached: int = 0
    failed: int = 0
    unparsed: int = 0
    last_errors: list[str] = field(default_factory=list)


class Judge:
    """``fn(completions, rows) -> list[float | None]``: the judge's score of each completion (module docstring)."""

    runs_in_caller = True  # network requests and a resident model: never sent to the reward worker
    returns_none = True

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.__name__ = config.name or "judge"
        self.counts = JudgeCounts()  # over the run
        self.last_call = JudgeCounts()  # of the latest call (logged per step)
        self._count_lock = threading.Lock()
        self._cache: dict[str, str] = {}
        self._backend = OpenAIChatBackend(config) if config.backend == "openai" else LocalBackend(config)

    def prompt(self, completion: str, row: dict[str, Any]) -> str:
        return self.config.rubric.format(problem=row.get("problem", ""), answer=row.get("answer", ""),
                                         completion=completion)

    def _replies(self, prompts: list[str], rows: Sequence[dict[str, Any]]) -> list[str | None]:
        todo = [i for i, p in enumerate(prompts) if not (self.config.cache and p in self._cache)]
        self.last_call.cached += len(prompts) - len(todo)
        distinct: dict[str, int] = {}
        for i in todo:
            distinct.setdefault(prompts[i], i)
        fresh: dict[str, str | None] = {}
        if isinstance(self._backend, OpenAIChatBackend):
            def ask(prompt: str) -> str | None:
                try:
                    return self._backend.reply(prompt)
                except Exception as exc:  # noqa: BLE001 - any failure scores None and is counted
                    with self._count_lock:
                        self.last_call.failed += 1
                        self.last_call.last_errors = (self.last_call.last_errors + [f"{type(exc).__name__}: {exc}"])[-5:]
                    return None

            with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
                for prompt, reply in zip(distinct, pool.map(ask, list(distinct))):
                    fresh[prompt] = reply
        elif distinct:
            order = list(distinct)
            try:
                texts = self._backend.replies(order, [rows[distinct[p]] for p in order])
            except Exception as exc:  # noqa: BLE001 - a failed judge scores None for these and is counted
                self.last_call.failed += len(order)
                self.last_call.last_errors = [f"{type(exc).__name__}: {exc}"]
                texts = [None] * len(order)
            fresh.update(zip(order, texts))
        self.last_call.requests += len(distinct)
        for prompt, reply in fresh.items():
            if reply is not None and self.config.cache:
                self._cache[prompt] = reply
        return [self._cache.get(p) if self.config.cache and p in self._cache else fresh.get(p) for p in prompts]

    def __call__(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[float | None]:
        self.last_call = JudgeCounts()
        prompts = [self.prompt(c, r) for c, r in zip(completions, rows)]
        scores: list[float | None] = []
        for reply in self._replies(prompts, rows):
            if reply is None:
                scores.append(None)
                continue
            score = parse_score(reply, self.config.score_pattern, self.config.scale)
            if score is None:
                self.last_call.unparsed += 1
            scores.append(score)
        call = self.last_call
        for name in ("requests", "cached", "failed", "unparsed"):
            setattr(self.counts, name, getattr(self.counts, name) + getattr(call, name))
        self.counts.last_errors = (self.counts.last_errors + call.last_errors)[-5:]
        return scores


_JUDGES: dict[tuple[str, float], Judge] = {}


def judge(name: str) -> Judge:
    """The :class:`Judge` of spec ``judge:FILE.yaml``, one per file in the process (its cache and counts kept)."""
    path = Path(name[len(JUDGE_PREFIX):]).expanduser().resolve()
    if not str(name[len(JUDGE_PREFIX):]):
        raise ValueError("judge spec 'judge:' names no file")
    key = (str(path), path.stat().st_mtime if path.is_file() else 0.0)
    found = _JUDGES.get(key)
    if found is None:
        found = _JUDGES.setdefault(key, Judge(load_judge_config(path)))
    return found
