"""TAROT (authorship obfuscation by policy optimisation): privacy and utility rewards from two text encoders,
and the DPO pair builder.

Official code: hornetsecurity/tarot.

- ``tarot/train_ppo.py`` ``rewards_function``: for a source text x and its rewrite y,
  ``privacy = 1 - cos(style(x), style(y))`` (style: the LUAR-MUD authorship encoder) and
  ``utility = cos(semantic(x), semantic(y))`` (semantic: the gte-large-en-v1.5 sentence encoder); the PPO
  reward is ``utility + privacy``.
- ``tarot/create_dpo_dataset.py``: two rewrites (``right`` = the first sample of each source, ``left`` = the
  second) become a (chosen, rejected) pair when ``|privacy_right - privacy_left| > 0.10`` and
  ``|utility_right - utility_left| < 0.05``; the one with the higher privacy reward is chosen (a tie is
  skipped).

An encoder is a function ``texts -> Tensor (N, D)``: a checkpoint (:class:`TextEncoder`: mean or CLS pooling
of ``AutoModel`` hidden states, the logits of an ``AutoModelForSequenceClassification``, or a model whose
output already is the embedding, called with LUAR's (N, 1, L) episode layout) or a function of your own
(``file.py:fn``). In a run, ``kind: tarot`` in ``rewards.models`` (mmpo.rewards.models) is this reward, the
source text read from the row's ``source_column``; its parts are logged as ``rewards/<name>/privacy`` and
``rewards/<name>/utility``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

PRIVACY_MARGIN = 0.10
"""Keep a DPO pair when the privacy rewards differ by more than this (``create_dpo_dataset.py``)."""

UTILITY_TOLERANCE = 0.05
"""... and the utility rewards by less than this (``create_dpo_dataset.py``)."""

POOLINGS = ("mean", "cls", "logits", "output")


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of (N, D) tensors (a zero vector gives 0), in float64."""
    a, b = a.double(), b.double()
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(norms > 0, (a * b).sum(-1) / norms.clamp_min(1e-300), torch.zeros_like(norms))


def tarot_rewards(style_x: torch.Tensor, style_y: torch.Tensor, semantic_x: torch.Tensor,
                  semantic_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, privacy, utility), each (N,): privacy = 1 - cos(style(x), style(y)), utility =
    cos(semantic(x), semantic(y)), total = privacy + utility (``train_ppo.rewards_function``)."""
    privacy = 1.0 - cosine(style_x, style_y)
    utility = cosine(semantic_x, semantic_y)
    return privacy + utility, privacy, utility


def dpo_pairs(prompts: Sequence[str], right: Sequence[str], left: Sequence[str], *,
              style: Callable[[list[str]], torch.Tensor], semantic: Callable[[list[str]], torch.Tensor],
              privacy_margin: float = PRIVACY_MARGIN, utility_tolerance: float = UTILITY_TOLERANCE,
              ) -> list[dict[str, Any]]:
    """TAROT's DPO pairs from two rewrites per source (``create_dpo_dataset.py``, module docstring).

    Returns one ``{"prompt", "chosen", "rejected", "privacy_chosen", "privacy_rejected", "utility_chosen",
    "utility_rejected"}`` per kept source, in order.
    """
    if not len(prompts) == len(right) == len(left):
        raise ValueError(f"got {len(prompts)} prompts, {len(right)} right and {len(left)} left rewrites")
    if not prompts:
        return []
    prompts, right, left = list(prompts), list(right), list(left)
    style_x, semantic_x = style(prompts), semantic(prompts)
    _, privacy_r, utility_r = tarot_rewards(style_x, style(right), semantic_x, semantic(right))
    _, privacy_l, utility_l = tarot_rewards(style_x, style(left), semantic_x, semantic(left))
    pairs = []
    for i in range(len(prompts)):
        pr, pl, ur, ul = float(privacy_r[i]), float(privacy_l[i]), float(utility_r[i]), float(utility_l[i])
        if not (abs(pr - pl) > privacy_margin and abs(ur - ul) < utility_tolerance) or pr == pl:
            continue
        if pr > pl:
            chosen, rejected, pc, prj, uc, urj = right[i], left[i], pr, pl, ur, ul
        else:
            chosen, rejected, pc, prj, uc, urj = left[i], right[i], pl, pr, ul, ur
        pairs.append({"prompt": prompts[i], "chosen": chosen, "rejected": rejected, "privacy_chosen": pc,
                      "privacy_rejected": prj, "utility_chosen": uc, "utility_rejected": urj})
    return pairs


def write_dpo_pairs(path: str, pairs: Sequence[Mapping[str, Any]], *, overwrite: bool = False) -> str:
    """Write TAROT pairs as jsonl (one ``{"id", "prompt", "chosen", "rejected", ...}`` a line), atomically; an
    existing file is kept unless ``overwrite``. The file loads as DPO data with
    ``load_preference_rows(path, keys=ColumnKeys(prompt_key="prompt"))`` / ``PreferenceDataModule``."""
    import json
    from pathlib import Path

    from mmpo.files import atomic_write_text

    if Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    lines = [json.dumps({"id": f"tarot-{index}", **dict(pair)}) for index, pair in enumerate(pairs)]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return str(path)


class TextEncoder:
    """A checkpoint as ``texts -> Tensor (N, D)`` (float32 on the CPU), resident on its device.

    ``pooling``: ``mean`` (masked mean of the last hidden state; sentence encoders such as gte-base),
    ``cls`` (the first token's state; gte-*-v1.5), ``logits`` (a sequence classifier's logits, e.g. an
    authorship classifier), ``output`` (the model returns the embedding and takes (N, 1, L) inputs, as
    LUAR-MUD in ``train_ppo.py``).
    """

    def __init__(self, path: str, *, pooling: str = "mean", device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 32, max_length: int = 512, trust_remote_code: bool = False) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        from mmpo.rewards.models import resolve_device

        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.path, self.pooling, self.batch_size, self.max_length = path, pooling, batch_size, max_length
        self.device = resolve_device(device)
        model_class = AutoModelForSequenceClassification if pooling == "logits" else AutoModel
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = model_class.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a text encoder from {path!r}: {exc}") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        """The (N, D) embeddings; a text with no tokens (an empty rewrite) embeds as the zero vector, whose cosine
        with anything is 0."""
        texts = list(texts)
        kept = [i for i, text in enumerate(texts) if self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        if len(kept) == len(texts):
            return self._embed(texts)
        if kept:
            embedded = self._embed([texts[i] for i in kept])
        else:  # the embedding width without a forward pass
            config = self.model.config
            width = config.num_labels if self.pooling == "logits" else getattr(config, "hidden_size", 1)
            embedded = torch.zeros(0, width)
        out = torch.zeros(len(texts), embedded.shape[1])
        out[kept] = embedded
        return out

    def _embed(self, texts: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start:start + self.batch_size])
            self.tokenizer.padding_side = "right"
            inputs = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt").to(self.device)
            if self.pooling == "output":
                n = len(chunk)
                value = self.model(input_ids=inputs["input_ids"].reshape(n, 1, -1),
                                   attention_mask=inputs["attention_mask"].reshape(n, 1, -1))
                out.append(torch.as_tensor(value).float().cpu().reshape(n, -1))
            elif self.pooling == "logits":
                out.append(self.model(**inputs).logits.float().cpu())
            else:
                hidden = self.model(**inputs).last_hidden_state.float()
                if self.pooling == "cls":
                    out.append(hidden[:, 0].cpu())
                else:
                    mask = inputs["attention_mask"].unsqueeze(-1).float()
                    out.append(((hidden * mask).sum(1) / mask.sum(1).clamp_min(1)).cpu())
        return torch.cat(out) if out else torch.zeros(0, 0)


def load_encoder(settings: Any, what: str) -> Callable[[list[str]], torch.Tensor]:
    """An encoder from its setting: ``file.py:fn`` / ``module:fn`` (a function of your own) or a mapping of
    :class:`TextEncoder` arguments (``path``, ``pooling``...)."""
    if isinstance(settings, str):
        from mmpo.plugins import PluginSpecError, load_function, parse_spec

        try:
            return load_function(parse_spec(settings, "encoder"))
        except PluginSpecError as exc:
            raise ValueError(f"{what}: {exc}") from None
    if isinstance(settings, Mapping) and "path" in settings:
        try:
            return TextEncoder(**dict(settings))
        except TypeError as exc:
            raise ValueError(f"{what}: {exc}") from None
    raise ValueError(f"{what}: expected 'file.py:function' or a mapping with path (and pooling, device...), "
                     f"got {settings!r}")


class TarotReward:
    """``kind: tarot``: reward = 1 - cos(style(x), style(y)) + cos(semantic(x), semantic(y)), x the row's
    ``source_column``, y the completion. ``metrics`` holds the call's mean ``privacy`` and ``utility``."""

    runs_in_process = True

    def __init__(self, name: str, spec: Any) -> None:
        self.name, self.spec = name, spec
        self.style = load_encoder(spec.style_encoder, f"rewards.models.{name}.style_encoder")
        self.semantic = load_encoder(spec.semantic_encoder, f"rewards.models.{name}.semantic_encoder")
        self.metrics: dict[str, float] = {}

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
        column = self.spec.source_column
        missing = [i for i, row in enumerate(rows) if not isinstance(row.get(column), str)]
        if missing:
            raise LookupError(f"TAROT needs the source text in column {column!r}; row {missing[0]} has none")
        sources = [row[column] for row in rows]
        total, privacy, utility = tarot_rewards(self.style(sources), self.style(list(completions)),
                                                self.semantic(sources), self.semantic(list(completions)))
        self.metrics = {"privacy": float(privacy.mean()) if len(rows) else 0.0,
                        "utility": float(utility.mean()) if len(rows) else 0.0}
        return total.float()
