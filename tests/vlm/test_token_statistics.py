"""completion_token_statistics (the optimal token baseline's inputs) against the logits that
``generate`` sampled from."""

from __future__ import annotations

import torch

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from mmpo.vlm.logprobs import completion_log_probs, completion_token_statistics
from mmpo.vlm.processing import encode_prompts, model_inputs
from mmpo.vlm.rollout import HFGenerateEngine

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


def test_token_statistics_match_the_sampling_distribution(tmp_path):
    model, processor = load_vlm(build_tiny_vlm(tmp_path / "tiny", corpus=CORPUS, vocab_size=350))
    rows = make_items("count_shapes", 1, seed=0) + make_items("arithmetic", 1, seed=0)
    temperature = 0.7
    torch.manual_seed(1)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=6, temperature=temperature)
    inputs = model_inputs(encode_prompts(processor, rows))
    torch.manual_seed(1)
    out = model.generate(
        **inputs, max_new_tokens=6, num_return_sequences=2, do_sample=True, temperature=temperature, top_k=0,
        top_p=1.0, return_dict_in_generate=True, output_logits=True,
        eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id,
    )
    width = rollout.completion_ids.shape[1]
    mask = rollout.completion_mask.bool()
    probs = torch.softmax(torch.stack(out.logits, 1)[:, :width].float() / temperature, -1)
    log_probs, sum_squares = completion_token_statistics(
        model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask,
        temperature=temperature, chunk_size=5,  # chunks straddle rows
    )
    assert log_probs.shape == sum_squares.shape == (4, width) and not sum_squares.requires_grad
    torch.testing.assert_close(sum_squares[mask], (probs**2).sum(-1)[mask], atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        expected, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids,
                                           rollout.completion_mask, temperature=temperature)
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)
