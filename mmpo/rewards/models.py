"""Rewards from models: reward-model checkpoints and generative judges, weighted like any other reward.

A run names its model rewards in ``rewards.models`` (name -> settings) and weights them in
``rewards.weights`` under the same name, beside registered rewards and user functions::

    rewards:
      weights: {accuracy: 0.9, helpful_rm: 0.5, judge: 0.3}
      models:
        helpful_rm: {kind: classifier, path: runs/tiny/reward_model, device: auto, dtype: float32}
        judge: {kind: judge, url: http://127.0.0.1:8000, model: Qwen/Qwen2.5-7B-Instruct}

Kinds (docs/rewards.md):

- ``classifier``: an ``AutoModelForSequenceClassification`` checkpoint with its own tokenizer. The
  question (the row's ``problem``) and the completion are rendered as a user / assistant chat with the
  reward model's own chat template (plain ``prompt + "\\n" + completion`` when it has none), tokenized
  with right padding, scored in batches of ``batch_size``; the reward is ``logits[:, label_index]``
  (TRL's ``GRPOTrainer`` takes ``logits[:, 0]``).
- ``judge``: a generative judge. ``rubric`` is a ``str.format`` template over ``{prompt}``,
  ``{completion}`` and any column of the row (``{answer}``...); the judge's reply is searched with
  ``score_pattern`` (the last match's first group is the score); a score inside
  [``min_score``, ``max_score``] is the reward (rescaled to [0, 1] with ``normalize``). The judge is
  either a local causal LM or VLM (``path``; the row's images go to a VLM judge with the rubric) or an
  OpenAI-compatible ``/v1/chat/completions`` endpoint (``url``: a vLLM or SGLang server) called with
  a per-request timeout, retries with exponential backoff, at most ``max_concurrency`` requests at
  once and a response cache. A reply without a score in range, or a request that still fails after
  its retries, scores None (not applicable: that completion's total skips the judge) and is counted
  in ``rewards/<name>/unparseable`` or ``rewards/<name>/failed``: a judge never crashes a run.

Each model is loaded once, when the setting is validated (before the policy loads), and kept resident
on its own ``device`` and ``dtype`` for the whole run. Model rewards run in the training process (a
thread with the reward deadline, ``mmpo.rewards.compute``), not in the reward worker, which would load
its own copy.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import logging
import math
import numbers
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from mmpo.rewards.log_text import shorten

logger = logging.getLogger(__name__)

KINDS = ("classifier", "judge", "tarot")

DEFAULT_RUBRIC = (
    "You are grading an answer to a question.\n"
    "Question: {prompt}\n"
    "Answer: {completion}\n"
    "Rate the answer's correctness and clarity from 0 to 10. "
    "End your reply with a line 'Score: <number>'."
)
"""The default judge rubric (fields ``{prompt}`` and ``{completion}``); a 0-10 scale, as in the
LLM-as-a-judge prompts of MT-Bench (Zheng et al. 2023, "Single Answer Grading")."""

DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
"""Finds ``Score: 7`` / ``score=7.5`` / ``Score: **8**``; the last match in a reply counts."""

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelRewardSpec:
    """The settings of one model reward (``rewards.models.<name>``); see the module docstring.

    Attributes:
        kind: ``classifier`` (a reward model) or ``judge`` (a generative judge).
        path: checkpoint directory (classifier, or a local judge).
        url: base URL of an OpenAI-compatible server (an HTTP judge), e.g. ``http://127.0.0.1:8000``.
        backend: a judge of your own, ``path/to/file.py:factory`` or ``package.module:factory``: ``factory(spec)``
            returns an object with ``generate(texts, images) -> list[str]`` (replies) and a ``cache``
            (:class:`ResponseCache`); e.g. the rule judges of the MPO testbed (``mmpo.algos.mpo_testbed``).
        model: the model name sent to the server (``"model"`` of the request).
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``...
        dtype: the weights' dtype: float32, bfloat16 or float16.
        batch_size: completions per forward pass (classifier, local judge).
        label_index: the logit that is the reward (classifier; TRL takes 0).
        rubric: judge prompt template (``{prompt}``, ``{completion}``, row columns).
        system_prompt: the judge's system turn (None: none).
        score_pattern: regex whose first group is the score (last match wins).
        score_reduce: ``last`` (the last match is the score) or ``sum`` (every match is a score in range and
            the reward is their sum: a rubric scored item by item, MPO's reward model).
        min_score, max_score: the valid range of a score; a score outside it is unparseable.
        normalize: rescale a score to ``(s - min_score) / (max_score - min_score)``.
        max_new_tokens: judge reply length.
        temperature: judge sampling temperature (0 = greedy).
        images: pass the row's images to the judge (a VLM, or an endpoint serving one).
        request_timeout_s: per-request timeout of an HTTP judge.
        max_retries: retries of a failed request (connection error, timeout, HTTP 429 / 5xx).
        backoff_s: first retry delay; doubled each retry.
        max_concurrency: HTTP requests in flight at once.
        cache_size: replies kept in the response cache (0 = no cache); keyed by the whole request.
        api_key_env: environment variable holding a bearer token for the endpoint (None: no header).
        style_encoder, semantic_encoder: TAROT's two encoders (``kind: tarot``, :mod:`mmpo.rewards.tarot`):
            ``file.py:fn`` or a mapping of ``TextEncoder`` settings (``path``, ``pooling``, ``device``...).
        source_column: the row column holding TAROT's source text x (default ``problem``).
    """

    kind: str
    path: str | None = None
    url: str | None = None
    backend: str | None = None
    model: str | None = None
    device: str = "auto"
    dtype: str = "float32"
    batch_size: int = 16
    label_index: int = 0
    rubric: str = DEFAULT_RUBRIC
    system_prompt: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    score_reduce: str = "last"
    min_score: float = 0.0
    max_score: float = 10.0
    normalize: bool = True
    max_new_tokens: int = 64
    temperature: float = 0.0
    images: bool = True
    request_timeout_s: float = 30.0
    max_retries: int = 2
    backoff_s: float = 0.5
    max_concurrency: int = 4
    cache_size: int = 4096
    api_key_env: str | None = None
    style_encoder: Any = None
    semantic_encoder: Any = None
    source_column: str = "problem"

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.kind in KINDS, f"kind must be one of {KINDS}, got {self.kind!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kind == "tarot":
            need(self.style_encoder is not None and self.semantic_encoder is not None,
                 "kind tarot needs style_encoder and semantic_encoder")
        elif self.kind == "classifier":
            need(self.path is not None, "a classifier needs path (an AutoModelForSequenceClassification checkpoint)")
            need(self.url is None and self.backend is None,
                 "a classifier is loaded from path; url and backend are for judges")
        else:
            need(sum(x is not None for x in (self.path, self.url, self.backend)) == 1,
                 "a judge needs exactly one of path (a local causal LM or VLM), url (an OpenAI-compatible server) "
                 "and backend (a judge of your own, 'file.py:factory')")
            need(self.score_reduce in ("last", "sum"), f"score_reduce must be last or sum, got {self.score_reduce!r}")
            need(self.url is None or self.url.startswith(("http://", "https://")),
                 f"url must start with http:// or https://, got {self.url!r}")
            need(self.min_score < self.max_score, f"min_score {self.min_score} must be < max_score {self.max_score}")
            try:
                pattern = re.compile(self.score_pattern)
            except re.error as exc:
                raise ValueError(f"score_pattern {self.score_pattern!r} is not a regex: {exc}") from None
            need(pattern.groups >= 1, f"score_pattern {self.score_pattern!r} needs a group capturing the score")
            fields = rubric_fields(self.rubric)
            need("completion" in fields, f"the rubric must contain {{completion}}, got fields {sorted(fields)}")
        for name in ("batch_size", "max_new_tokens", "max_concurrency"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_retries", "cache_size", "label_index"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.request_timeout_s > 0, f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        need(self.backoff_s >= 0, f"backoff_s must be >= 0, got {self.backoff_s}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")


def rubric_fields(rubric: str) -> set[str]:
    """The ``{field}`` names of a rubric template (ValueError for a malformed template)."""
    try:
        return {field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(rubric)
                if field is not None and field != ""}
    except ValueError as exc:
        raise ValueError(f"the rubric is not a str.format template: {exc}") from None


def parse_spec(name: str, settings: Any) -> ModelRewardSpec:
    """``rewards.models.<name>`` as a :class:`ModelRewardSpec` (ValueError naming the reward and the problem)."""
    if isinstance(settings, ModelRewardSpec):
        return settings
    if not isinstance(settings, Mapping):
        raise ValueError(f"rewards.models.{name}: expected a mapping of settings, got {settings!r}")
    known = {field.name for field in dataclasses.fields(ModelRewardSpec)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"rewards.models.{name}: unknown setting(s) {unknown}; valid: {sorted(known)}")
    try:
        return ModelRewardSpec(**dict(settings))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rewards.models.{name}: {exc}") from None


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _row_prompt(row: Mapping[str, Any]) -> str:
    return str(row.get("problem", ""))


# ---------------------------------------------------------------------------------------------- classifier


class ClassifierReward:
    """A reward model: ``AutoModelForSequenceClassification`` + its tokenizer, resident on its device.

    Called as a registered reward ``fn(completions, rows) -> Tensor (N,)``.
    """

    runs_in_process = True
    """compute_rewards runs it in this process (the worker would load a second copy)."""

    def __init__(self, name: str, spec: ModelRewardSpec) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name, self.spec = name, spec
        self.device = resolve_device(spec.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.path)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                spec.path, dtype=getattr(torch, spec.dtype)).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise ValueError(f"rewards.models.{name}: cannot load a sequence classifier from {spec.path!r}: "
                             f"{shorten(str(exc))}") from None
        if self.tokenizer.pad_token is None:  # Llama-style tokenizers: pad with EOS (masked out)
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the classifier pools the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        num_labels = int(self.model.config.num_labels)
        if spec.label_index >= num_labels:
            raise ValueError(f"rewards.models.{name}: label_index {spec.label_index} but the model has "
                             f"{num_labels} label(s)")
        self.metrics: dict[str, float] = {}

    def render(self, prompt: str, completion: str) -> str:
        """The text scored: the question and the completion as a user / assistant chat in the reward
        model's own template (TRL's ``GRPOTrainer`` for conversational data), else joined by a newline."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return f"{prompt}\n{completion}"

    @torch.no_grad()
    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
        texts = [self.render(_row_prompt(row), completion) for completion, row in zip(completions, rows)]
        scores: list[torch.Tensor] = []
        for start in range(0, len(texts), self.spec.batch_size):
            chunk = texts[start:start + self.spec.batch_size]
            self.tokenizer.padding_side = "right"
            inputs = self.tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            inputs = {key: value.to(self.device) for key, value in inputs.items()}
            logits = self.model(**inputs).logits
            scores.append(logits[:, self.spec.label_index].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def __repr__(self) -> str:
        return f"ClassifierReward({self.name!r}, {self.spec.path!r} on {self.device})"


# ---------------------------------------------------------------------------------------------- judges


def parse_score(reply: str, spec: ModelRewardSpec) -> float | None:
    """The reward a judge's reply gives: the last ``score_pattern`` match in [min_score, max_score]
    (rescaled to [0, 1] with ``normalize``); None when there is none or it is out of range."""
    matches = list(re.finditer(spec.score_pattern, reply))
    if not matches:
        return None
    values: list[float] = []
    for match in (matches if spec.score_reduce == "sum" else matches[-1:]):
        try:
            score = float(match.group(1))
        except (TypeError, ValueError):
            return None
        if not math.isfinite(score) or not spec.min_score <= score <= spec.max_score:
            return None
        values.append((score - spec.min_score) / (spec.max_score - spec.min_score) if spec.normalize else score)
    return sum(values)


def judge_prompt(rubric: str, prompt: str, completion: str, row: Mapping[str, Any]) -> str:
    """The rubric filled with ``prompt``, ``completion`` and the row's columns (KeyError naming a missing one)."""
    values = {key: value for key, value in row.items() if isinstance(key, str)}
    values.update(prompt=prompt, completion=completion)
    try:
        return rubric.format_map(values)
    except KeyError as exc:
        raise KeyError(f"the rubric names {{{exc.args[0]}}} but the row has no such column; its columns: "
                       f"{sorted(values)}") from None


class ResponseCache:
    """A thread-safe LRU of judge replies keyed by the SHA-256 of the whole request."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(request: Any) -> str:
        return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]

    def put(self, key: str, reply: str) -> None:
        if self.size == 0:
            return
        with self._lock:
            self._items[key] = reply
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def image_data_url(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (OpenAI's ``image_url`` content part)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class JudgeFailure(RuntimeError):
    """A judge request that failed after its retries."""


class HTTPJudgeBackend:
    """An OpenAI-compatible chat-completions endpoint: timeouts, retries with backoff, a concurrency
    limit (a thread pool of ``max_concurrency``) and a response cache."""

    RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})

    def __init__(self, spec: ModelRewardSpec) -> None:
        self.spec = spec
        self.endpoint = spec.url.rstrip("/") + ("" if spec.url.rstrip("/").endswith("/chat/completions")
                                                else "/v1/chat/completions")
        self.cache = ResponseCache(spec.cache_size)
        self.pool = ThreadPoolExecutor(max_workers=spec.max_concurrency, thread_name_prefix="judge-http")
        self.requests_sent = 0
        self._count_lock = threading.Lock()

    def request(self, text: str, images: Sequence[Any]) -> dict[str, Any]:
        content: Any = text
        if images:
            content = [*({"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images),
                       {"type": "text", "text": text}]
        messages = ([{"role": "system", "content": self.spec.system_prompt}] if self.spec.system_prompt else [])
        messages.append({"role": "user", "content": content})
        return {"model": self.spec.model or "default", "messages": messages,
                "max_tokens": self.spec.max_new_tokens, "temperature": self.spec.temperature}

    def _post(self, body: dict[str, Any]) -> str:
        import os

        headers = {"Content-Type": "application/json"}
        if self.spec.api_key_env:
            token = os.environ.get(self.spec.api_key_env)
            if token:
                headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode()
        delay = self.spec.backoff_s
        last = "no attempt"
        for attempt in range(self.spec.max_retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            with self._count_lock:
                self.requests_sent += 1
            try:
                request = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.spec.request_timeout_s) as response:
                    payload = json.loads(response.read().decode())
                return str(payload["choices"][0]["message"]["content"])
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
                if exc.code not in self.RETRY_STATUS:
                    break
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except (ValueError, KeyError, IndexError, TypeError) as exc:  # not a chat-completions reply
                last = f"malformed reply ({type(exc).__name__}: {exc})"
                break
        raise JudgeFailure(f"{self.endpoint}: {last}")

    def _reply(self, text: str, images: Sequence[Any]) -> str:
        body = self.request(text, images)
        key = ResponseCache.key(body)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        reply = self._post(body)
        self.cache.put(key, reply)
        return reply

    def generate(self, texts: list[str], images: list[list[Any]]) -> list[str | JudgeFailure]:
        def one(index: int) -> str | JudgeFailure:
            try:
                return self._reply(texts[index], images[index])
            except JudgeFailure as exc:
                return exc

        return list(self.pool.map(one, range(len(texts))))


class LocalJudgeBackend:
    """A local causal LM or VLM (``mmpo.vlm.factory.load_vlm``) generating replies in batches, resident
    on its own device; a VLM judge sees the row's images before the rubric (``encode_prompts``)."""

    def __init__(self, name: str, spec: ModelRewardSpec) -> None:
        from mmpo.vlm.factory import is_text_processor, load_vlm

        self.spec = spec
        self.device = resolve_device(spec.device)
        try:
            model, self.processor = load_vlm(spec.path, dtype=spec.dtype)
        except (OSError, ValueError) as exc:
            raise ValueError(f"rewards.models.{name}: cannot load a judge from {spec.path!r}: "
                             f"{shorten(str(exc))}") from None
        self.model = model.to(self.device).eval()
        self.text_only = is_text_processor(self.processor)
        self.cache = ResponseCache(spec.cache_size)

    @torch.no_grad()
    def _generate_batch(self, texts: list[str], images: list[list[Any]]) -> list[str]:
        from mmpo.vlm.processing import encode_prompts, model_inputs

        rows = [{"id": f"judge-{index}", "problem": text, "images": [] if self.text_only else list(pictures)}
                for index, (text, pictures) in enumerate(zip(texts, images))]
        inputs = encode_prompts(self.processor, rows, system_prompt=self.spec.system_prompt)
        inputs = {key: value.to(self.device) if isinstance(value, torch.Tensor) else value
                  for key, value in model_inputs(inputs).items()}
        tokenizer = self.processor.tokenizer
        sample = self.spec.temperature > 0
        out = self.model.generate(**inputs, max_new_tokens=self.spec.max_new_tokens, do_sample=sample,
                                  temperature=self.spec.temperature if sample else None, top_p=None, top_k=None,
                                  pad_token_id=tokenizer.pad_token_id)
        new = out[:, inputs["input_ids"].shape[1]:]
        return tokenizer.batch_decode(new, skip_special_tokens=True)

    def generate(self, texts: list[str], images: list[list[Any]]) -> list[str | JudgeFailure]:
        replies: list[str | JudgeFailure | None] = [None] * len(texts)
        keys = [ResponseCache.key([text, [image_data_url(i) for i in pictures] if not self.text_only else []])
                if self.spec.cache_size and self.spec.temperature == 0 else None
                for text, pictures in zip(texts, images)]
        todo = []
        for index, key in enumerate(keys):
            cached = self.cache.get(key) if key is not None else None
            if cached is not None:
                replies[index] = cached
            else:
                todo.append(index)
        for start in range(0, len(todo), self.spec.batch_size):
            chunk = todo[start:start + self.spec.batch_size]
            try:
                outs: list[str | JudgeFailure] = list(self._generate_batch([texts[i] for i in chunk],
                                                                           [images[i] for i in chunk]))
            except (RuntimeError, ValueError, TypeError) as exc:  # a failed batch is not applicable, not fatal
                outs = [JudgeFailure(f"{type(exc).__name__}: {exc}")] * len(chunk)
            for index, reply in zip(chunk, outs):
                replies[index] = reply
                if isinstance(reply, str) and keys[index] is not None:
                    self.cache.put(keys[index], reply)
        return replies  # type: ignore[return-value]


def make_judge_backend(name: str, spec: ModelRewardSpec) -> Any:
    """The backend of a judge spec: HTTP (``url``), local (``path``) or your own (``backend``)."""
    if spec.url is not None:
        return HTTPJudgeBackend(spec)
    if spec.path is not None:
        return LocalJudgeBackend(name, spec)
    from mmpo.plugins import PluginSpecError, load_function, parse_spec as parse_plugin_spec

    try:
        factory = load_function(parse_plugin_spec(spec.backend, "judge"))
    except PluginSpecError as exc:
        raise ValueError(f"rewards.models.{name}: {exc}") from None
    backend = factory(spec)
    if not callable(getattr(backend, "generate", None)) or not hasattr(backend, "cache"):
        raise ValueError(f"rewards.models.{name}: {spec.backend!r} returned {type(backend).__name__}, which has no "
                         "generate(texts, images) and cache")
    return backend


class JudgeReward:
    """A generative judge as a reward ``fn(completions, rows) -> list[float | None]``.

    After each call ``metrics`` holds ``unparseable`` and ``failed`` (judgements of this call scored
    None) and ``cache_hits`` (total so far); compute_rewards logs them as ``rewards/<name>/*``.
    ``last_replies`` keeps the call's raw replies (a failure as its error text).
    """

    runs_in_process = True

    def __init__(self, name: str, spec: ModelRewardSpec, backend: Any | None = None) -> None:
        self.name, self.spec = name, spec
        if backend is None:
            backend = make_judge_backend(name, spec)
        self.backend = backend
        self.metrics: dict[str, float] = {}
        self.last_replies: list[str] = []
        self.unparseable_total = 0
        self.failed_total = 0

    def prompts(self, completions: list[str], rows: list[dict[str, Any]], rubric: str | None = None) -> list[str]:
        """The judge prompts: the rubric (``rubric`` or the spec's) filled per completion."""
        rubric = self.spec.rubric if rubric is None else rubric
        return [judge_prompt(rubric, _row_prompt(row), completion, row) for completion, row in zip(completions, rows)]

    def judge(self, completions: list[str], rows: list[dict[str, Any]],
              rubric: str | None = None) -> list[float | None]:
        """Scores under ``rubric`` (default: the spec's); see the class docstring."""
        texts = self.prompts(completions, rows, rubric)
        images = [list(row.get("images") or []) if self.spec.images else [] for row in rows]
        replies = self.backend.generate(texts, images)
        scores: list[float | None] = []
        unparseable = failed = 0
        self.last_replies = []
        for reply in replies:
            if isinstance(reply, JudgeFailure):
                failed += 1
                scores.append(None)
                self.last_replies.append(f"<failed: {reply}>")
                continue
            score = parse_score(reply, self.spec)
            unparseable += score is None
            scores.append(score)
            self.last_replies.append(reply)
        if failed:
            logger.warning("judge %r: %d of %d judgements failed (scored None), e.g. %s", self.name, failed,
                           len(replies), shorten(next(r for r in self.last_replies if r.startswith("<failed"))))
        self.unparseable_total += unparseable
        self.failed_total += failed
        self.metrics = {"unparseable": float(unparseable), "failed": float(failed),
                        "cache_hits": float(self.backend.cache.hits)}
        return scores

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> list[float | None]:
        return self.judge(completions, rows)

    def __repr__(self) -> str:
        return f"JudgeReward({self.name!r}, {self.spec.url or self.spec.path!r})"


# ---------------------------------------------------------------------------------------------- registry

MODEL_REWARDS: dict[str, Any] = {}
"""Model rewards by name, loaded once and kept for the process (``register_model_rewards``)."""

_SPECS: dict[str, ModelRewardSpec] = {}


def build_model_reward(name: str, spec: ModelRewardSpec) -> Callable:
    """The reward object of ``spec`` (loads the model)."""
    if spec.kind == "tarot":
        from mmpo.rewards.tarot import TarotReward

        return TarotReward(name, spec)
    return ClassifierReward(name, spec) if spec.kind == "classifier" else JudgeReward(name, spec)


def register_model_rewards(models: Mapping[str, Any] | None) -> dict[str, Callable]:
    """Parse, load (once per name and settings) and register ``rewards.models``; returns name -> reward.

    Raises:
        ValueError: a bad name or setting, or a checkpoint that does not load (naming the reward).
    """
    if not models:
        return {}
    from mmpo.rewards.registry import REWARDS

    out: dict[str, Callable] = {}
    for name, settings in models.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"rewards.models: a model reward's name must be an identifier, got {name!r}")
        if name in REWARDS:
            raise ValueError(f"rewards.models.{name}: {name!r} is a registered reward; pick another name")
        spec = parse_spec(name, settings)
        if _SPECS.get(name) != spec or name not in MODEL_REWARDS:
            MODEL_REWARDS[name] = build_model_reward(name, spec)
            _SPECS[name] = spec
        out[name] = MODEL_REWARDS[name]
    return out


def get_model_reward(name: str) -> Callable | None:
    """The registered model reward ``name`` (None when there is none)."""
    return MODEL_REWARDS.get(name)


def is_model_reward(name: str) -> bool:
    return name in MODEL_REWARDS


def reward_call_metrics(fn: Any) -> dict[str, float]:
    """The per-call counters a model reward leaves in ``.metrics`` (empty for other rewards)."""
    metrics = getattr(fn, "metrics", None)
    if not isinstance(metrics, Mapping):
        return {}
    return {str(key): float(value) for key, value in metrics.items() if isinstance(value, numbers.Real)}
