"""Mask predictors: a real LLaDA / LLaDA2 checkpoint, or a tiny one built from a config.

A masked-diffusion LM is a bidirectional Transformer that predicts every ``[MASK]``
position at once (LLaDA, arXiv 2502.09992). transformers 5.24 ships no LLaDA class, so

- a real checkpoint (LLaDA-8B, LLaDA2) loads through the Auto class its ``auto_map``
  names, with ``trust_remote_code`` only when the caller asks for it;
- the tiny default is ``ModernBertForMaskedLM`` (a bidirectional encoder with rotary
  positions and a ``[MASK]`` token) built from a ``ModernBertConfig``, plus a tokenizer
  trained locally (``mmpo.dllm.tokenizer``).

Both are saved with ``save_pretrained`` (safetensors) and reloaded by the same
:func:`load_mask_predictor`, so the real-checkpoint path and the tiny one are one path.
A small ``mmpo_dllm.json`` beside the weights records the generation defaults and marks
the folder as a dLLM checkpoint for ``mmpo eval``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

DLLM_MARKER_FILE = "mmpo_dllm.json"


@dataclass
class TinyMaskPredictorConfig:
    """Size of the tiny ModernBERT-style mask predictor."""

    hidden_size: int = 128
    """model width"""
    num_layers: int = 4
    """number of bidirectional Transformer layers"""
    num_heads: int = 4
    """attention heads"""
    intermediate_size: int = 256
    """MLP width"""
    max_positions: int = 256
    """maximum canvas length (prompt + completion)"""


def build_tiny_mask_predictor(tokenizer: Any, config: TinyMaskPredictorConfig | None = None) -> torch.nn.Module:
    """A randomly initialised ``ModernBertForMaskedLM`` sized by ``config`` for ``tokenizer``."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = config or TinyMaskPredictorConfig()
    if tokenizer.mask_token_id is None:
        raise ValueError("the tokenizer has no mask token; a masked-diffusion LM needs one")
    model_config = ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        # Full (global) attention in every layer: the canvas is short and LLaDA attends globally.
        global_attn_every_n_layers=1,
        local_attention=config.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        cls_token_id=None,
        sep_token_id=None,
        tie_word_embeddings=True,
    )
    return ModernBertForMaskedLM(model_config)


def _auto_class_for(path: str, trust_remote_code: bool) -> Any:
    import transformers

    config_file = Path(path) / "config.json"
    auto_map = {}
    if config_file.is_file():
        auto_map = json.loads(config_file.read_text()).get("auto_map", {}) or {}
    if auto_map and not trust_remote_code:
        raise ValueError(
            f"{path} needs custom model code ({sorted(auto_map)}); pass trust_remote_code=True if you trust it"
        )
    # LLaDA-8B maps AutoModel (and AutoModelForCausalLM), LLaDA2 AutoModelForCausalLM; ours is a masked LM.
    for name in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"):
        if not auto_map or name in auto_map:
            return getattr(transformers, name)
    raise ValueError(f"{path}: config auto_map {sorted(auto_map)} names no model class we can load")


def load_mask_predictor(
    path: str | Path, *, trust_remote_code: bool = False, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` from a saved folder (tiny or real LLaDA / LLaDA2).

    Args:
        path: folder holding ``config.json``, weights and tokenizer files.
        trust_remote_code: allow the checkpoint's own modelling code (LLaDA needs it).
        dtype: load the weights in this dtype (e.g. ``torch.bfloat16`` for an 8B model).
    """
    from transformers import AutoTokenizer

    path = str(path)
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path!r} (config.json missing)")
    auto_class = _auto_class_for(path, trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = auto_class.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if mask_token_id(tokenizer, model) is None:
        raise ValueError(f"{path}: neither the tokenizer nor the config defines a mask token id")
    return model, tokenizer


def mask_token_id(tokenizer: Any, model: torch.nn.Module | None = None) -> int | None:
    """The ``[MASK]`` id from the tokenizer, else from the model config (LLaDA: 126336)."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if model is not None and getattr(model.config, "mask_token_id", None) is not None:
        return int(model.config.mask_token_id)
    return None


def save_mask_predictor(
    model: torch.nn.Module, tokenizer: Any, path: str | Path, *, generation: dict[str, Any] | None = None
) -> None:
    """Save weights (safetensors), config, tokenizer and the dLLM marker with generation defaults.

    A LoRA-wrapped model (``mmpo.training.lora``) is saved as plain merged weights, loadable without peft,
    and its adapter alone goes to ``path / "adapter"``.
    """
    from mmpo.training.lora import is_lora, save_merged_and_adapter

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        save_merged_and_adapter(model, path)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker = {"kind": "masked-diffusion-lm", "generation": generation or {}}
    (path / DLLM_MARKER_FILE).write_text(json.dumps(marker, indent=2))


def read_generation_defaults(path: str | Path) -> dict[str, Any]:
    """The generation settings saved with a checkpoint (empty if none were saved)."""
    marker = Path(path) / DLLM_MARKER_FILE
    if not marker.is_file():
        return {}
    return dict(json.loads(marker.read_text()).get("generation", {}))


def mask_predictor_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``(batch, seq) -> (batch, seq, vocab)`` logits of a mask predictor.

    ``attention_mask`` hides left padding (1 = real token); LLaDA's reference sampler
    attends to padding, a difference that only matters for batched prompts of unequal length.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out[0]


def format_prompt(tokenizer: Any, problem: str) -> str:
    """Prompt text: the chat template when the tokenizer has one (real LLaDA), else ``problem + '\\n'``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=False
        )
    return problem + "\n"


def encode_prompts(tokenizer: Any, problems: list[str]) -> tuple[Tensor, Tensor]:
    """Left-padded ``(input_ids, attention_mask)``, both ``(batch, prompt_len)``."""
    texts = [format_prompt(tokenizer, p) for p in problems]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(ids), width), int(pad), dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        if seq:
            input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention[row, width - len(seq) :] = 1
    return input_ids, attention


def encode_completions(tokenizer: Any, texts: list[str], gen_length: int) -> Tensor:
    """``(batch, gen_length)`` completion ids: text, then EOS padding to ``gen_length`` (LLaDA SFT).

    A text longer than ``gen_length - 1`` tokens raises ValueError naming it: the fixed
    generation budget must hold the whole answer plus one EOS.
    """
    eos = tokenizer.eos_token_id
    out = torch.full((len(texts), gen_length), int(eos), dtype=torch.long)
    for row, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > gen_length - 1:
            raise ValueError(f"completion {row} ({text[:40]!r}...) has {len(ids)} tokens > gen_length - 1 = {gen_length - 1}")
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def decode_completions(tokenizer: Any, completions: Tensor) -> list[str]:
    """Decode ``(batch, L)`` completions, cutting each at its first EOS (and dropping masks)."""
    eos = tokenizer.eos_token_id
    texts = []
    for row in completions.tolist():
        if eos in row:
            row = row[: row.index(eos)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def generation_dict(**settings: Any) -> dict[str, Any]:
    """JSON-safe copy of generation settings (dataclasses are flattened)."""
    out = {}
    for key, value in settings.items():
        out[key] = asdict(value) if hasattr(value, "__dataclass_fields__") else value
    return out
