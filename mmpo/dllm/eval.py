"""``mmpo eval`` support for masked-diffusion LM checkpoints.

The eval harness (``mmpo.eval.harness``) asks :func:`is_dllm_checkpoint` whether a folder
is a dLLM and then calls :func:`load_answerer`; importing this module registers the text
benchmark ``mmpo/dllm/arith`` (held-out arithmetic problems, scored by :mod:`mmpo.dllm.rewards`)
with ``mmpo.eval.registry.register_benchmark(..., modality="dllm")``.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from mmpo.dllm.modeling import DLLM_MARKER_FILE, load_mask_predictor, read_generation_defaults
from mmpo.dllm.rewards import is_correct
from mmpo.dllm.rollout import rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.dllm.task import ArithmeticTaskConfig, make_train_and_test

ARITH_BENCHMARK = "mmpo/dllm/arith"
ARITH_TEST_SIZE = 256


def is_dllm_checkpoint(path: str) -> bool:
    """True for a folder saved by ``dllm`` (marker file) or a LLaDA-family config."""
    folder = Path(path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        return False
    if (folder / DLLM_MARKER_FILE).is_file():
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return "llada" in str(config.get("model_type", "")).lower()


class DiffusionAnswerer:
    """Answers text rows with the LLaDA block sampler.

    Args:
        model, tokenizer: a loaded mask predictor.
        sampler: generation settings; greedy answers use them at temperature 0.
        sample_temperature: temperature when ``greedy`` is False.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, sampler: SamplerConfig, sample_temperature: float = 1.0):
        self.model, self.tokenizer, self.sampler = model.eval(), tokenizer, sampler
        self.sample_temperature = sample_temperature

    @torch.no_grad()
    def answer(self, rows: list[dict[str, Any]], num_samples: int, greedy: bool) -> list[list[str]]:
        """``num_samples`` completions per row (identical copies under greedy decoding)."""
        for row in rows:
            for key in ("id", "problem"):
                if key not in row:
                    raise ValueError(f"row {row.get('id', '?')!r} has no {key!r} field")
        config = replace(self.sampler, temperature=0.0 if greedy else self.sample_temperature)
        repeats = 1 if greedy else num_samples
        problems = [str(row["problem"]) for row in rows for _ in range(repeats)]
        texts = rollout(self.model, self.tokenizer, problems, config).texts
        if greedy:
            return [[text] * num_samples for text in texts]
        return [texts[i * repeats : (i + 1) * repeats] for i in range(len(rows))]


def load_answerer(path: str, **gen_kwargs: Any) -> DiffusionAnswerer:
    """Load a dLLM checkpoint as an answerer.

    ``gen_kwargs`` may override :class:`SamplerConfig` fields (``gen_length``, ``block_length``,
    ``steps``); ``temperature`` sets the sampling temperature of non-greedy answers;
    ``trust_remote_code`` is passed to the loader; other harness keys (``max_new_tokens``)
    are ignored because the canvas length is ``gen_length``.
    """
    trust_remote_code = bool(gen_kwargs.pop("trust_remote_code", False))
    model, tokenizer = load_mask_predictor(path, trust_remote_code=trust_remote_code)
    saved = read_generation_defaults(path).get("sampler", {})
    names = {f.name for f in fields(SamplerConfig)}
    settings = {k: v for k, v in saved.items() if k in names}
    settings.update({k: v for k, v in gen_kwargs.items() if k in names and k != "temperature" and v is not None})
    temperature = gen_kwargs.get("temperature")
    return DiffusionAnswerer(model, tokenizer, SamplerConfig(**settings), 1.0 if temperature is None else float(temperature))


def load_arith_rows(size: int = ARITH_TEST_SIZE, task: ArithmeticTaskConfig | None = None) -> list[dict[str, Any]]:
    """The held-out arithmetic split the training data module also holds out (seed 0)."""
    _, test = make_train_and_test(task or ArithmeticTaskConfig(), train_size=0, test_size=size, seed=0)
    return test


def arith_scorer(completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
    """``(N,)`` 1.0 where the completion's final answer matches the row's answer."""
    return torch.tensor([float(is_correct(c, str(r["answer"]))) for c, r in zip(completions, rows)])


def register_dllm_benchmarks() -> None:
    """Register ``mmpo/dllm/arith`` with the eval registry (idempotent)."""
    from mmpo.eval.registry import register_benchmark

    register_benchmark(
        ARITH_BENCHMARK,
        load_arith_rows,
        modality="dllm",
        scorer=arith_scorer,
        description=f"held-out left-to-right arithmetic ({ARITH_TEST_SIZE} problems, 2 operations, values 0..30)",
        overwrite=True,
    )


try:
    register_dllm_benchmarks()
except ModuleNotFoundError as error:  # an install without mmpo.eval: nothing to register with
    if error.name is None or not "mmpo.eval.registry".startswith(error.name):
        raise
