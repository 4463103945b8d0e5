"""A reward model checkpoint as a reward: ``rm:PATH`` in ``rewards.weights`` (TRL's ``reward_funcs`` model path).

PATH is a local ``AutoModelForSequenceClassification`` checkpoint (one output: the score) with its own tokenizer;
each (prompt, completion) is rendered with that tokenizer's chat template (a user turn with the row's
``problem``, an assistant turn with the completion) or, without a template, as prompt + completion, and scored in
batches. Options after ``?``: ``device`` (default: the trainer's, else cpu), ``dtype`` (float32, bfloat16,
float16; default the checkpoint's), ``batch_size`` (default 16), e.g.
``rm:/models/rm?device=cuda:1&dtype=bfloat16``.

The model is loaded once, on the first call, and stays resident in the training process (it runs there, not in
the reward worker: a model is not re-loaded per call); its scores join the other rewards under the same weights,
``rewards/<label>/*`` logs (label ``rm_<directory name>``), non-finite rejection and clamping, and the per-call
deadline (a thread in the training process, as for a function that cannot be pickled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs

RM_PREFIX = "rm:"
_OPTIONS = {"device", "dtype", "batch_size"}
_DTYPES = ("float32", "bfloat16", "float16")


def is_reward_model_spec(name: str) -> bool:
    return name.startswith(RM_PREFIX)


@dataclass(frozen=True)
class RewardModelSpec:
    """A parsed ``rm:PATH?options`` spec."""

    path: str
    device: str | None = None
    dtype: str | None = None
    batch_size: int = 16

    @property
    def label(self) -> str:
        """The ``<label>`` of its ``rewards/<label>/*`` metrics."""
        return "rm_" + Path(self.path).name


def parse_reward_model_spec(name: str) -> RewardModelSpec:
    """Parse and check ``rm:PATH?device=...&dtype=...&batch_size=...`` (the path must hold a checkpoint with a
    ``config.json`` of a sequence-classification model with one label); raises ValueError naming the problem."""
    body = name[len(RM_PREFIX):]
    path, _, query = body.partition("?")
    if not path:
        raise ValueError(f"reward model spec {name!r}: no checkpoint path after 'rm:'")
    options = {key: values[-1] for key, values in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"reward model spec {name!r}: unknown option(s) {unknown}; valid: {sorted(_OPTIONS)}")
    dtype = options.get("dtype")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"reward model spec {name!r}: dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    try:
        batch_size = int(options.get("batch_size", 16))
    except ValueError:
        raise ValueError(f"reward model spec {name!r}: batch_size must be an integer") from None
    if batch_size < 1:
        raise ValueError(f"reward model spec {name!r}: batch_size must be >= 1, got {batch_size}")
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward model spec {name!r}: no checkpoint at {path} (config.json not found)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward model spec {name!r}: {path} is a {architectures or 'model without architectures'}, "
                         f"not an AutoModelForSequenceClassification checkpoint")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"reward model spec {name!r}: a reward model has one output (num_labels 1), got {labels}")
    return RewardModelSpec(str(Path(path).expanduser().resolve()), options.get("device"), dtype, batch_size)


class RewardModel:
    """``fn(completions, rows) -> (N,) scores`` of a reward-model checkpoint, loaded on the first call."""

    runs_in_caller = True  # a resident model: never sent to the reward worker

    def __init__(self, spec: RewardModelSpec) -> None:
        self.spec = spec
        self.__name__ = spec.label
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        spec = self.spec
        self._tokenizer = AutoTokenizer.from_pretrained(spec.path)
        dtype = getattr(torch, spec.dtype) if spec.dtype else "auto"
        model = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=dtype)
        if model.config.pad_token_id is None:  # batched scoring reads the last non-pad token
            model.config.pad_token_id = self._tokenizer.pad_token_id
        self._device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._model = model.to(self._device).eval()

    def texts(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
        """What the reward model reads for each completion (its chat template, else prompt + completion)."""
        if self._tokenizer is None:
            self._load()
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            return [tokenizer.apply_chat_template([{"role": "user", "content": str(row.get("problem", ""))},
                                                   {"role": "assistant", "content": completion}], tokenize=False)
                    for completion, row in zip(completions, rows)]
        return [str(row.get("problem", "")) + completion for completion, row in zip(completions, rows)]

    def __call__(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[float]:
        import torch

        texts = self.texts(completions, rows)
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.spec.batch_size):
                batch = self._tokenizer(texts[start:start + self.spec.batch_size], return_tensors="pt",
                                        padding=True, add_special_tokens=False).to(self._device)
                logits = self._model(**batch).logits
                scores += logits[:, 0].float().cpu().tolist()
        return scores


_LOADED: dict[RewardModelSpec, RewardModel] = {}


def reward_model(name: str) -> RewardModel:
    """The :class:`RewardModel` of spec ``name``, one per checkpoint and options in the process (loaded once,
    kept resident; a relative path is resolved from the working directory first)."""
    spec = parse_reward_model_spec(name)
    model = _LOADED.get(spec)
    if model is None:
        model = _LOADED.setdefault(spec, RewardModel(spec))
    return model
