"""SFTModule: completion-only loss (parity with HF's labels loss), learning, HF export."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.algos.sft import SFTModule
from mmpo.data import SYSTEM_PROMPT, render_solution
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import OptimConfig
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import sequence_inputs
from mmpo.vlm.processing import encode_completions, encode_prompts, model_inputs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def _rows():
    return make_items("count_shapes", 2, seed=0) + make_items("arithmetic", 1, seed=0)


def test_loss_is_hf_labels_loss_on_completion_tokens_only(tiny_path):
    """Parity: our chunked loss == HF's ``labels`` cross-entropy with prompt and padding at -100."""
    module = SFTModule(tiny_path)
    rows = _rows()
    loss, _ = module.sft_loss(rows)

    processor = module.processor
    prompts = encode_prompts(processor, rows, system_prompt=module.system_prompt)
    ids, mask = encode_completions(processor, [render_solution(r) for r in rows])
    inputs = sequence_inputs(prompts, ids, mask)
    labels = inputs["input_ids"].clone()
    labels[:, : prompts["input_ids"].shape[1]] = -100  # no loss on the prompt (image tokens included)
    labels[inputs["attention_mask"] == 0] = -100
    reference = module.model(**model_inputs(inputs), labels=labels).loss
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    # and it is not the loss over the whole sequence
    whole = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    assert abs(float(module.model(**model_inputs(inputs), labels=whole).loss) - float(loss)) > 1e-3


def test_sft_lowers_the_loss_and_saves_hf_weights(tiny_path, tmp_path):
    rows = _rows()
    module = SFTModule(tiny_path, optim=OptimConfig(lr=3e-3), output_dir=str(tmp_path / "hf"))
    before = float(module.sft_loss(rows)[0])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=15, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows] * 15, batch_size=None, collate_fn=lambda x: x))
    after = float(module.sft_loss(rows)[0])
    assert after < 0.7 * before, (before, after)
    saved, processor = load_vlm(tmp_path / "hf")
    for (name, p), q in zip(module.model.named_parameters(), saved.parameters()):
        assert torch.equal(p.detach(), q), name
    assert processor.tokenizer.get_vocab() == module.processor.tokenizer.get_vocab()


def test_bad_settings(tiny_path):
    with pytest.raises(ValueError, match="lr must be > 0"):
        SFTModule(tiny_path, optim=OptimConfig(lr=0.0))
    with pytest.raises(ValueError, match="unknown style 'essay'"):
        SFTModule(tiny_path, style="essay")
