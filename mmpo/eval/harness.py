"""The eval harness: generate k answers per item, score them, report accuracy, avg@k and pass@k.

* :func:`evaluate` — a loaded VLM (``model``, ``processor``) on rows, through the
  trainer's ``HFGenerateEngine`` (the same generation path as RL rollouts).
* :func:`evaluate_answerer` — any object with ``.answer(rows, num_samples, greedy)``
  (the dLLM agent's ``mmpo.dllm.eval.load_answerer``).
* :func:`evaluate_checkpoint` — a saved checkpoint on named benchmarks; dispatches
  dLLM checkpoints to ``mmpo.dllm.eval`` and everything else to ``load_vlm``; optionally
  writes ``results.json``, ``results.md``, ``accuracy.png`` and per-item predictions.

Correctness: a completion is correct when its score is > 0.5; the default score
is the shared ``accuracy`` reward (math-verify on the ``<answer>`` / ``\\boxed{}``
content), so the numbers match the RL reward. pass@k: arXiv 2107.03374.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mmpo.eval.benchmarks.base import decode_row_images
from mmpo.eval.metrics import summarize_correctness
from mmpo.eval.registry import Row, load_benchmark_rows, resolve_benchmark

if TYPE_CHECKING:
    from mmpo.eval.judge_extraction import JudgeEval

CORRECT_THRESHOLD = 0.5
DEFAULT_MAX_NEW_TOKENS = 128


Judge = Callable[[str, Row], tuple["str | None", float]]
"""A benchmark's own rule: ``fn(completion, row) -> (extracted answer or None, score in [0, 1])``."""


class NotAModelError(ValueError):
    """A path that is neither a saved HF model directory nor a dLLM checkpoint."""


@dataclass(frozen=True)
class ToolUse:
    """Evaluate with tools: multi-turn rollouts (:mod:`mmpo.vlm.multiturn`) where the model may call ``tools``
    (names or specs, as ``AgentConfig.tools``) for at most ``max_turns`` model turns and ``max_total_tokens``
    completion tokens; tools run in the sandbox with a ``tool_timeout_s`` deadline per call."""

    tools: tuple[str, ...]
    max_turns: int = 3
    max_total_tokens: int = 512
    max_calls_per_turn: int = 4
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("tool use needs at least one tool")
        for name in ("max_turns", "max_total_tokens", "max_calls_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# ----------------------------------------------------------------------------- scoring


def score_completions(
    completions: Sequence[Sequence[str]],
    rows: Sequence[Row],
    *,
    scorer: Callable[[list[str], list[Row]], torch.Tensor] | None = None,
) -> tuple[list[list[bool]], list[list[float]], dict[str, float]]:
    """Score ``completions[i][j]`` (sample j of item i) against ``rows[i]``.

    Args:
        completions: (num_items, num_samples) strings.
        rows: num_items rows.
        scorer: ``fn(completions, rows) -> Tensor (N,)``; ``None`` uses the shared
            ``accuracy`` reward (with the rewards module's timeout) and also sums the
            ``format`` reward (think/answer format) into ``format_sum``.

    Returns:
        (correct (num_items, num_samples) bools, scores (same shape) floats, counters:
        ``format_sum`` (default scorer) and ``reward_errors`` (completions whose scoring
        failed or timed out and counted as wrong)).
    """
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completion lists for {len(rows)} rows")
    num_samples = {len(samples) for samples in completions}
    if len(num_samples) != 1:
        raise ValueError(f"every item needs the same number of samples, got {sorted(num_samples)}")
    k = num_samples.pop()
    flat_completions = [text for samples in completions for text in samples]
    flat_rows = [row for row in rows for _ in range(k)]
    counters: dict[str, float] = {}
    if scorer is None:
        scores, format_scores, errors = _default_scores(flat_completions, flat_rows)
        counters["format_sum"] = float(format_scores.sum())
        counters["reward_errors"] = float(errors)
    else:
        scores = torch.as_tensor(scorer(flat_completions, flat_rows), dtype=torch.float32)
    scores = scores.reshape(len(rows), k)
    correct = (scores > CORRECT_THRESHOLD).tolist()
    return correct, scores.tolist(), counters


def _default_scores(completions: list[str], rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Accuracy and format rewards with the rewards module's timeout.

    A failed or timed-out call gives zeros there; then each completion is rescored
    on its own so that one pathological answer does not zero a whole batch.
    Returns (accuracy (N,), format (N,), number of completions that still failed).
    """
    from mmpo.rewards import compute_rewards

    weights = {"accuracy": 1.0, "format": 0.0}
    _total, per_fn, metrics = compute_rewards(weights, completions, rows)
    batch_failed = any(metrics.get(f"rewards/{name}/errors") for name in weights)
    if not batch_failed or len(completions) == 1:
        failed = len(completions) if metrics.get("rewards/accuracy/errors") else 0
        return per_fn["accuracy"], per_fn["format"], failed
    accuracy, formats, failed = torch.zeros(len(completions)), torch.zeros(len(completions)), 0
    for index, (completion, row) in enumerate(zip(completions, rows)):
        _total, single, single_metrics = compute_rewards(weights, [completion], [row])
        accuracy[index], formats[index] = single["accuracy"][0], single["format"][0]
        failed += int(bool(single_metrics.get("rewards/accuracy/errors")))
    return accuracy, formats, failed


def judge_completions(
    completions: Sequence[Sequence[str]], rows: Sequence[Row], judge: Judge,
) -> tuple[list[list[bool]], list[list[float]], list[list[str | None]]]:
    """Score with a benchmark's own rule: (correct, scores, extracted answers), each (num_items, num_samples)."""
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completion lists for {len(rows)} rows")
    judged = [[judge(text, row) for text in samples] for samples, row in zip(completions, rows)]
    scores = [[float(score) for _answer, score in item] for item in judged]
    correct = [[score > CORRECT_THRESHOLD for score in item] for item in scores]
    return correct, scores, [[answer for answer, _score in item] for item in judged]


def item_record(row: Row, samples: Sequence[str], flags: Sequence[bool], scores: Sequence[float],
                extracted: Sequence[str | None]) -> dict[str, Any]:
    """One line of ``predictions/<benchmark>.jsonl``: the prompt, its images, the k completions, the
    extracted answers, the gold answer and each completion's score and correctness."""
    images = row.get("image_sources")
    if images is None:
        images = [f"<image {index}: {getattr(image, 'size', '?')}>" for index, image in enumerate(row.get("images") or [])]
    return {"id": row["id"], "task": row.get("task"), "prompt": row.get("problem"), "images": list(images),
            "answer": row.get("answer"), "completions": list(samples), "extracted": list(extracted),
            "scores": [float(score) for score in scores], "correct": list(flags)}


def summarize(
    rows: Sequence[Row],
    completions: Sequence[Sequence[str]],
    correct: Sequence[Sequence[bool]],
    extra: Mapping[str, float] | None = None,
    scores: Sequence[Sequence[float]] | None = None,
    extracted: Sequence[Sequence[str | None]] | None = None,
) -> dict[str, Any]:
    """Metrics overall and per task, plus per-item records (``predictions`` key, see :func:`item_record`).

    ``extra`` holds counters summed over batches (``format_sum`` becomes ``format_rate``).
    ``scores`` / ``extracted`` default to the correctness flags and the RL reward's extraction.
    """
    from mmpo.rewards.answers import extract_answer

    results: dict[str, Any] = summarize_correctness(correct)
    counters = dict(extra or {})
    if "format_sum" in counters:
        results["format_rate"] = counters.pop("format_sum") / (results["num_items"] * results["num_samples"])
    results.update(counters)
    by_task_indices: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        by_task_indices.setdefault(str(row.get("task", "unknown")), []).append(index)
    results["by_task"] = {
        task: summarize_correctness([correct[i] for i in indices]) for task, indices in by_task_indices.items()
    }
    scores = scores if scores is not None else [[float(flag) for flag in flags] for flags in correct]
    extracted = extracted if extracted is not None else [[extract_answer(text) for text in samples]
                                                         for samples in completions]
    results["predictions"] = [
        item_record(*item) for item in zip(rows, completions, correct, scores, extracted)
    ]
    return results


def _score_batch(
    batch_completions: list[list[str]],
    batch: list[Row],
    scorer: Callable[[list[str], list[Row]], torch.Tensor] | None,
    judged: dict[str, list],
    counters: dict[str, float],
    judge: Judge | None = None,
) -> None:
    """Score one batch and append to the running ``judged`` lists (completions, correct, scores,
    extracted) and ``counters``."""
    if judge is not None:
        batch_correct, batch_scores, batch_extracted = judge_completions(batch_completions, batch, judge)
    else:
        from mmpo.rewards.answers import extract_answer

        batch_correct, batch_scores, batch_counters = score_completions(batch_completions, batch, scorer=scorer)
        batch_extracted = [[extract_answer(text) for text in samples] for samples in batch_completions]
        for key, value in batch_counters.items():
            counters[key] = counters.get(key, 0.0) + value
    for key, values in (("completions", batch_completions), ("correct", batch_correct),
                        ("scores", batch_scores), ("extracted", batch_extracted)):
        judged.setdefault(key, []).extend(values)


def _running_accuracy(judged: dict[str, list]) -> float:
    correct = judged.get("correct", [])
    total = sum(len(flags) for flags in correct)
    return sum(sum(flags) for flags in correct) / total if total else 0.0


def _batches(rows: Sequence[Row], batch_size: int):
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(rows), batch_size):
        yield list(rows[start:start + batch_size])


@contextlib.contextmanager
def _seeded(seed: int | None):
    """Seed torch's RNGs for the block and restore them afterwards (no side effect on the caller)."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _check_decoding(num_samples: int, greedy: bool, temperature: float) -> None:
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if greedy and num_samples > 1:
        raise ValueError(f"greedy decoding gives {num_samples} identical samples; use num_samples=1 or sample "
                         "with a temperature")
    if not greedy and temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    processor: Any,
    rows: Sequence[Row],
    *,
    num_samples: int = 1,
    greedy: bool = True,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    scorer: Callable[[list[str], list[Row]], torch.Tensor] | None = None,
    seed: int | None = 0,
    progress: bool = True,
    description: str = "eval",
    system_prompt: str | None = "default",
    judge: Judge | None = None,
    tool_use: ToolUse | None = None,
) -> dict[str, Any]:
    """Evaluate a loaded VLM on ``rows``.

    Args:
        model, processor: from ``mmpo.vlm.factory.load_vlm``.
        rows: contract rows (``id``, ``images``, ``problem``, ``answer``, ``task``, ...).
        num_samples: k answers per item (1 with ``greedy``).
        greedy: deterministic argmax decoding; otherwise sampling at ``temperature``/``top_p``.
        batch_size: prompts per ``generate`` call.
        scorer: see :func:`score_completions`.
        judge: a benchmark's own ``fn(completion, row) -> (extracted, score)`` (replaces ``scorer``).
        seed: torch seed for sampling, inside a forked RNG so the caller's RNG state is
            untouched (``None``: use the current RNG).
        system_prompt: ``"default"`` = ``mmpo.data.SYSTEM_PROMPT`` (what SFT teaches); ``None`` = none.
        tool_use: evaluate with tools (:class:`ToolUse`): each answer is a multi-turn rollout, scored on its last
            model message; ``max_new_tokens`` bounds each model turn.

    Returns:
        ``accuracy`` (greedy accuracy, or mean over samples), ``avg@k``, ``pass@k`` for
        k in 1, 2, 4, .., num_samples, ``num_items``, ``num_samples``, ``format_rate``
        (default scorer), ``by_task`` (same metrics per task), ``predictions`` (per item). With ``tool_use``
        also ``tool_call_rate`` (share of answers with at least one tool call), ``tool_calls_per_answer``,
        ``turns_per_answer``, ``tools/<name>/{calls,errors,timeouts}``, and per item the ``turns``,
        ``tool_calls`` and ``messages`` (the conversation) of each answer.
    """
    from mmpo.vlm.rollout import HFGenerateEngine

    _check_decoding(num_samples, greedy, temperature)
    rows = list(rows)
    if not rows:
        raise ValueError("evaluate needs at least one row")
    was_training = model.training
    model.eval()
    engine = HFGenerateEngine(model, processor, system_prompt=system_prompt)
    agent = _ToolRunner(engine, tool_use, max_new_tokens) if tool_use is not None else None
    judged: dict[str, list] = {}
    counters: dict[str, float] = {}
    try:
        with _seeded(seed), tqdm(total=len(rows), desc=description, unit="item", disable=not progress) as bar:
            for batch in _batches(rows, batch_size):
                # local-file benchmarks keep images encoded until their batch runs
                batch_rows = [decode_row_images(row) for row in batch]
                decoding = dict(num_samples=num_samples, temperature=temperature if not greedy else 1.0, top_p=top_p,
                                do_sample=not greedy)
                if agent is not None:
                    rollout = agent.generate(batch_rows, **decoding)
                else:
                    rollout = engine.generate(batch_rows, max_new_tokens=max_new_tokens, **decoding)
                texts = list(rollout.texts)
                if len(texts) != len(batch) * num_samples:
                    raise RuntimeError(f"engine returned {len(texts)} texts for {len(batch)} rows x {num_samples}")
                # The engine groups samples of one prompt contiguously.
                batch_completions = [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(batch))]
                # Scored per batch: the reward timeout applies to one call, and progress shows accuracy.
                _score_batch(batch_completions, batch, scorer, judged, counters, judge)
                bar.update(len(batch))
                bar.set_postfix(accuracy=f"{_running_accuracy(judged):.3f}")
    finally:
        model.train(was_training)
        if agent is not None:
            agent.close()
    results = summarize(rows, judged["completions"], judged["correct"], counters, judged["scores"],
                        judged["extracted"])
    if agent is not None:
        agent.report(results, num_samples)
    return results


class _ToolRunner:
    """Multi-turn tool-use answers for :func:`evaluate`: the engine, the tools, their sandbox and counts, and each
    answer's turns, tool calls and conversation."""

    def __init__(self, engine: Any, tool_use: ToolUse, max_new_tokens: int) -> None:
        from mmpo.tools.env import ToolStats
        from mmpo.tools.functions import load_tools
        from mmpo.tools.sandbox import SandboxLimits, ToolSandbox
        from mmpo.vlm.multiturn import MultiTurnEngine

        self.settings = tool_use
        self.tools = load_tools(list(tool_use.tools), "--tools")
        self.sandbox = ToolSandbox(SandboxLimits(timeout_s=tool_use.tool_timeout_s))
        self.stats = ToolStats()
        self.engine = MultiTurnEngine(engine, max_turns=tool_use.max_turns, max_total_tokens=tool_use.max_total_tokens,
                                      max_tokens_per_turn=max_new_tokens)
        self.turns: list[int] = []
        self.calls: list[int] = []
        self.messages: list[list[dict[str, str]]] = []

    def generate(self, rows: list[Row], *, num_samples: int, **decoding: Any) -> Any:
        from mmpo.tools.env import ToolEnvironment

        envs = [ToolEnvironment(self.tools, self.sandbox, stats=self.stats,
                                max_calls_per_turn=self.settings.max_calls_per_turn)
                for _ in range(len(rows) * num_samples)]
        rollout = self.engine.generate(rows, envs, num_samples=num_samples, **decoding)
        self.turns += rollout.extras["turns"].tolist()
        self.calls += rollout.extras["tool_calls"].tolist()
        self.messages += self.engine.last_transcripts
        return rollout

    def report(self, results: dict[str, Any], num_samples: int) -> None:
        """Add the tool metrics to ``results`` and each answer's turns, calls and conversation to its item."""
        answers = max(len(self.turns), 1)
        results["tool_call_rate"] = sum(calls > 0 for calls in self.calls) / answers
        results["tool_calls_per_answer"] = sum(self.calls) / answers
        results["turns_per_answer"] = sum(self.turns) / answers
        results["tools"] = list(self.settings.tools)
        results.update(self.stats.metrics())
        for index, item in enumerate(results["predictions"]):
            span = slice(index * num_samples, (index + 1) * num_samples)
            item["turns"], item["tool_calls"] = self.turns[span], self.calls[span]
            item["messages"] = self.messages[span]

    def close(self) -> None:
        self.sandbox.shutdown()


def evaluate_answerer(
    answerer: Any,
    rows: Sequence[Row],
    *,
    num_samples: int = 1,
    greedy: bool = True,
    batch_size: int = 8,
    scorer: Callable[[list[str], list[Row]], torch.Tensor] | None = None,
    seed: int | None = 0,
    progress: bool = True,
    description: str = "eval",
    judge: Judge | None = None,
) -> dict[str, Any]:
    """Evaluate an object with ``.answer(rows, num_samples, greedy) -> list[list[str]]`` (dLLM checkpoints).

    Returns the same dict as :func:`evaluate`.
    """
    _check_decoding(num_samples, greedy, temperature=1.0)
    rows = list(rows)
    if not rows:
        raise ValueError("evaluate_answerer needs at least one row")
    judged: dict[str, list] = {}
    counters: dict[str, float] = {}
    with _seeded(seed), tqdm(total=len(rows), desc=description, unit="item", disable=not progress) as bar:
        for batch in _batches(rows, batch_size):
            answers = answerer.answer(batch, num_samples, greedy)
            if len(answers) != len(batch) or any(len(samples) != num_samples for samples in answers):
                raise RuntimeError(f"{type(answerer).__name__}.answer returned the wrong shape for "
                                   f"{len(batch)} rows x {num_samples} samples (first row {batch[0]['id']!r})")
            _score_batch([list(samples) for samples in answers], batch, scorer, judged, counters, judge)
            bar.update(len(batch))
            bar.set_postfix(accuracy=f"{_running_accuracy(judged):.3f}")
    return summarize(rows, judged["completions"], judged["correct"], counters, judged["scores"], judged["extracted"])


# ----------------------------------------------------------------------------- checkpoints


def _dllm_eval_module():
    """``mmpo.dllm.eval`` when installed, else ``None`` (a VLM-only install)."""
    try:
        import mmpo.dllm.eval as dllm_eval
    except ModuleNotFoundError as error:
        if error.name is not None and "mmpo.dllm.eval".startswith(error.name):
            return None
        raise
    return dllm_eval


def detect_model_type(model_path: str | Path) -> str:
    """``"dllm"`` for a masked-diffusion checkpoint, ``"vlm"`` for a saved HF model directory.

    Raises:
        FileNotFoundError: the path does not exist.
        NotAModelError: it exists but is not a model (names what was expected).
    """
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    dllm_eval = _dllm_eval_module()
    if dllm_eval is not None and dllm_eval.is_dllm_checkpoint(str(path)):
        return "dllm"
    if path.is_dir() and (path / "config.json").is_file():
        return "vlm"
    raise NotAModelError(
        f"not a model: {path} (expected a directory written by save_pretrained, with config.json, "
        "e.g. from build_tiny_vlm or an SFT/GRPO run, or a dLLM checkpoint)"
    )


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_for_eval(
    model_path: str | Path,
    *,
    model_type: str | None = None,
    device: str | None = None,
    dtype: str = "float32",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    **gen_kwargs: Any,
):
    """Load ``model_path`` for evaluation: ``("vlm", (model, processor))`` or ``("dllm", answerer)``.

    Args:
        device: where a VLM runs (default :func:`default_device`); dLLM answerers place themselves.
        dtype: VLM weight dtype name (``float32``; ``bfloat16`` on GPUs).
        min_pixels, max_pixels: a VLM's image pixel budget, set on its processor as training does
            (``load_vlm``); None keeps the saved processor's.
        gen_kwargs: generation settings passed to ``mmpo.dllm.eval.load_answerer``.
    """
    model_type = model_type or detect_model_type(model_path)
    if model_type == "dllm":
        return model_type, _dllm_eval_module().load_answerer(str(model_path), **gen_kwargs)
    from mmpo.vlm.factory import load_vlm

    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. float32, bfloat16, float16")
    try:
        model, processor = load_vlm(str(model_path), dtype=getattr(torch, dtype), min_pixels=min_pixels,
                                    max_pixels=max_pixels)
    except (OSError, ValueError, KeyError) as error:
        raise NotAModelError(f"could not load {model_path} as a vision-language model: {error}") from error
    return model_type, (model.to(device or default_device()), processor)


def evaluate_checkpoint(
    model_path: str | Path,
    benchmarks: Sequence[str],
    *,
    num_samples: int = 1,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 8,
    limit: int | None = None,
    synth_size: int | None = None,
    synth_seed: int | None = None,
    synth_split: str = "test",
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    model: Any = None,
    device: str | None = None,
    dtype: str = "float32",
    system_prompt: str | None = "default",
    data_dir: str | Path | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    tool_use: ToolUse | None = None,
    judge_eval: "JudgeEval | None" = None,
) -> dict[str, Any]:
    """Evaluate a saved checkpoint on named benchmarks (see :mod:`mmpo.eval.registry`).

    Args:
        model_path: saved HF directory (VLM) or dLLM checkpoint.
        benchmarks: names such as ``synth/all``, ``synth/count_shapes``, ``file:data.jsonl``.
        limit: keep the first ``limit`` items of each benchmark.
        synth_size, synth_seed: size and seed of the synthetic test splits (registry defaults if None).
        synth_split: the split ``synth/...`` benchmarks draw from: ``"test"``, or ``"val"`` to choose settings.
        out_dir: when given, write ``results.json``, ``results.md``, ``accuracy.png`` and
            ``predictions/<benchmark>.jsonl`` there.
        model: an already loaded ``("vlm", (model, processor))`` / ``("dllm", answerer)`` pair
            from :func:`load_model_for_eval` (skips loading).
        device, dtype: where and in which precision a VLM runs (default: GPU if visible, float32).
        data_dir: folder with the local-file benchmarks' files (``mmpo.eval.benchmarks``).
        min_pixels, max_pixels: a VLM's image pixel budget (None: the saved processor's).
        tool_use: evaluate with tools (:class:`ToolUse`; VLMs and text LMs, not dLLMs).
        judge_eval: judge-score the benchmarks it selects (:class:`mmpo.eval.judge_extraction.JudgeEval`) after
            their rule scoring: each benchmark's metrics gain ``judge`` (judge accuracy, agreement with the rule,
            failures), its per-item predictions the judge's extraction and score per answer.

    Returns:
        The results dict described in :mod:`mmpo.eval.reports` (without per-item predictions).
    """
    if not benchmarks:
        raise ValueError("no benchmarks given")
    _check_decoding(num_samples, greedy, temperature)
    resolve_kwargs: dict[str, Any] = {"synth_split": synth_split}
    if synth_size is not None:
        resolve_kwargs["synth_size"] = synth_size
    if synth_seed is not None:
        resolve_kwargs["synth_seed"] = synth_seed
    # Resolve every name before loading anything, so a typo fails fast.
    resolved = [resolve_benchmark(name, data_dir=data_dir, **resolve_kwargs) for name in benchmarks]
    if tool_use is not None:
        from mmpo.tools.functions import load_tools

        load_tools(list(tool_use.tools), "--tools")  # a bad tool fails now, before the model loads
    judged_benchmarks: dict[str, str] = {}
    judge_backend = None
    if judge_eval is not None:  # a bad selection or judge fails now, before the model loads
        from mmpo.rewards.models import make_judge_backend

        judged_benchmarks = judge_eval.select([benchmark.name for benchmark in resolved])
        judge_backend = make_judge_backend("judge", judge_eval.spec)
    model_type, loaded = model if model is not None else load_model_for_eval(
        model_path, device=device, dtype=dtype, min_pixels=min_pixels, max_pixels=max_pixels,
        max_new_tokens=max_new_tokens, temperature=temperature)
    results: dict[str, Any] = {
        "model": str(model_path),
        "model_type": model_type,
        "decoding": {"greedy": greedy, "temperature": None if greedy else temperature, "top_p": top_p,
                     "num_samples": num_samples, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                     "limit": limit, "seed": seed},
        "benchmarks": {},
    }
    if tool_use is not None:
        results["tool_use"] = {"tools": list(tool_use.tools), "max_turns": tool_use.max_turns,
                               "max_total_tokens": tool_use.max_total_tokens,
                               "max_calls_per_turn": tool_use.max_calls_per_turn,
                               "tool_timeout_s": tool_use.tool_timeout_s}
    if data_dir is not None:
        results["data_dir"] = str(data_dir)
    if judge_eval is not None:
        results["judge"] = {**judge_eval.describe(), "benchmarks": list(judged_benchmarks)}
    predictions: dict[str, list[dict[str, Any]]] = {}
    for benchmark in resolved:
        rows = load_benchmark_rows(benchmark, limit=limit)
        started = time.perf_counter()
        common = dict(num_samples=num_samples, greedy=greedy, batch_size=batch_size, scorer=benchmark.scorer,
                      judge=benchmark.judge, seed=seed, progress=progress, description=benchmark.name)
        if model_type == "dllm" and tool_use is not None:
            raise ValueError(f"{model_path} is a dLLM checkpoint: --tools (multi-turn tool use) needs a VLM or a text LM")
        if model_type == "dllm":
            with_images = next((row for row in rows if row.get("images")), None)
            if with_images is not None:
                raise ValueError(f"{model_path} is a text-only dLLM checkpoint but benchmark {benchmark.name!r} "
                                 f"has images (item {with_images['id']!r}); use a text benchmark")
            metrics = evaluate_answerer(loaded, rows, **common)
        else:
            model_obj, processor = loaded
            metrics = evaluate(model_obj, processor, rows, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, system_prompt=system_prompt,
                               tool_use=tool_use, **common)
        predictions[benchmark.name] = metrics.pop("predictions")
        if benchmark.name in judged_benchmarks:
            from mmpo.eval.judge_extraction import judge_benchmark

            metrics["judge"] = judge_benchmark(judged_benchmarks[benchmark.name], rows, predictions[benchmark.name],
                                               judge_backend, mathverse_scoring=judge_eval.mathverse_scoring)
        metrics["seconds"] = round(time.perf_counter() - started, 2)
        results["benchmarks"][benchmark.name] = metrics
    if out_dir is not None:
        write_reports(results, out_dir, predictions=predictions)
    return results


def write_reports(
    results: Mapping[str, Any],
    out_dir: str | Path,
    *,
    predictions: Mapping[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Path]:
    """Write ``results.json``, ``results.md``, ``accuracy.png`` (and predictions) under ``out_dir``."""
    from mmpo.eval.plots import plot_accuracy_bars
    from mmpo.eval.reports import results_markdown, write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(results, out / "results.json")}
    paths["markdown"] = out / "results.md"
    paths["markdown"].write_text(results_markdown(results))
    accuracy = {name: metrics["accuracy"] for name, metrics in results["benchmarks"].items()}
    paths["plot"] = plot_accuracy_bars({Path(str(results["model"])).name or "model": accuracy},
                                       out / "accuracy.png")
    for name, items in (predictions or {}).items():
        safe = "".join(char if char.isalnum() or char in "-_." else "_" for char in name)
        path = out / "predictions" / f"{safe}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            for item in items:
                handle.write(json.dumps(item) + "\n")
        paths[f"predictions/{name}"] = path
    return paths
