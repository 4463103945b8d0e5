"""Text in, completions out: prompt encoding + the block sampler + decoding + accuracy."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mmpo.dllm.modeling import decode_completions, encode_prompts, mask_token_id
from mmpo.dllm.rewards import is_correct
from mmpo.dllm.sampler import SamplerConfig, generate


@dataclass
class Rollout:
    """Completions of a batch of prompts.

    Attributes:
        prompt_ids: ``(batch, P)`` left-padded prompt ids.
        prompt_attention_mask: ``(batch, P)``.
        completions: ``(batch, L)``.
        fixed_mask: ``(batch, L)`` True at hint positions.
        texts: decoded completions (cut at the first EOS).
    """

    prompt_ids: Tensor
    prompt_attention_mask: Tensor
    completions: Tensor
    fixed_mask: Tensor
    texts: list[str]


def rollout(
    model: torch.nn.Module,
    tokenizer,
    problems: list[str],
    config: SamplerConfig,
    *,
    fixed_tokens: Tensor | None = None,
    fixed_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Generate one completion per entry of ``problems`` (repeat a problem for a group)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, problems)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    out = generate(
        model,
        prompt_ids,
        prompt_mask,
        config,
        mask_token_id=mask_token_id(tokenizer, model),
        fixed_tokens=None if fixed_tokens is None else fixed_tokens.to(device),
        fixed_mask=None if fixed_mask is None else fixed_mask.to(device),
        generator=generator,
    )
    return Rollout(prompt_ids, prompt_mask, out.completions, out.fixed_mask, decode_completions(tokenizer, out.completions))


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict[str, str]],
    config: SamplerConfig,
    *,
    batch_size: int = 64,
    progress: bool = False,
) -> float:
    """Fraction of ``rows`` answered correctly with temperature-0 decoding."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    greedy = replace(config, temperature=0.0)
    was_training = model.training
    model.eval()
    correct = 0
    starts = range(0, len(rows), batch_size)
    for start in tqdm(starts, desc="greedy eval", disable=not progress):
        chunk = rows[start : start + batch_size]
        texts = rollout(model, tokenizer, [r["problem"] for r in chunk], greedy).texts
        correct += sum(is_correct(t, r["answer"]) for t, r in zip(texts, chunk))
    model.train(was_training)
    return correct / len(rows)


def sampled_accuracy(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict[str, str]],
    config: SamplerConfig,
    samples: int,
    *,
    generator: torch.Generator,
    batch_size: int = 128,
) -> float:
    """Fraction of ``samples`` completions per row, sampled with ``config`` (the training temperature) from
    ``generator``, that are correct: the held-out pass@1 estimate at the rollout temperature."""
    if not rows or samples < 1:
        raise ValueError(f"sampled_accuracy needs rows and samples >= 1, got {len(rows)} rows, {samples} samples")
    problems = [r["problem"] for r in rows for _ in range(samples)]
    answers = [r["answer"] for r in rows for _ in range(samples)]
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(problems), batch_size):
        texts = rollout(model, tokenizer, problems[start : start + batch_size], config, generator=generator).texts
        correct += sum(is_correct(t, a) for t, a in zip(texts, answers[start : start + batch_size]))
    model.train(was_training)
    return correct / len(problems)
