"""Shared fixtures of the dllm tests: a toy mask predictor and a tiny tokenizer/model."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class ToyMaskPredictor(torch.nn.Module):
    """logits[b, j] = E[input_ids[b, j]] + P[j] + mean over real tokens of F[input_ids]: cheap, bidirectional."""

    def __init__(self, vocab: int = 12, length: int = 64, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.token = torch.nn.Parameter(torch.randn(vocab, vocab, generator=generator))
        self.position = torch.nn.Parameter(torch.randn(length, vocab, generator=generator))
        self.context = torch.nn.Parameter(torch.randn(vocab, vocab, generator=generator) * 0.5)
        self.calls: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None):
        self.calls.append(input_ids.clone())
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        context = (self.context[input_ids] * mask[..., None]).sum(1, keepdim=True) / mask.sum(1, keepdim=True)[..., None]
        logits = self.token[input_ids] + self.position[: input_ids.shape[1]] + context
        return SimpleNamespace(logits=logits)


@pytest.fixture
def toy_model() -> ToyMaskPredictor:
    return ToyMaskPredictor()


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    from mmpo.dllm.modeling import TinyMaskPredictorConfig, build_tiny_mask_predictor
    from mmpo.dllm.task import ArithmeticTaskConfig, corpus
    from mmpo.dllm.tokenizer import train_char_tokenizer

    torch.manual_seed(0)
    tokenizer = train_char_tokenizer(corpus(ArithmeticTaskConfig(), size=200))
    model = build_tiny_mask_predictor(
        tokenizer, TinyMaskPredictorConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64)
    )
    return model.eval(), tokenizer
