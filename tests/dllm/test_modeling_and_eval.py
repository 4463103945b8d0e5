"""Tiny mask predictor: save/reload round-trip, checkpoint detection, eval answerer and registry."""

from __future__ import annotations

import json

import pytest
import torch

from mmpo.dllm.eval import ARITH_BENCHMARK, is_dllm_checkpoint, load_answerer, load_arith_rows
from mmpo.dllm.modeling import decode_completions, encode_completions, encode_prompts, load_mask_predictor, save_mask_predictor
from mmpo.dllm.sampler import SamplerConfig


def test_save_reload_round_trip(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    sampler = SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.0)
    save_mask_predictor(model, tokenizer, tmp_path / "ckpt", generation={"sampler": vars(sampler)})
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    loaded, loaded_tok = load_mask_predictor(tmp_path / "ckpt")
    ids = torch.tensor([[5, 6, 7, 1, 1]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits, atol=1e-6)
    assert loaded_tok.mask_token_id == tokenizer.mask_token_id == 1
    assert loaded_tok.decode(loaded_tok("12*3=36\nA:36", add_special_tokens=False)["input_ids"]) == "12*3=36\nA:36"
    assert is_dllm_checkpoint(str(tmp_path / "ckpt"))
    assert not is_dllm_checkpoint(str(tmp_path))


def test_remote_code_is_only_used_when_asked(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "remote")
    config_file = tmp_path / "remote" / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoModel": "modeling_llada.LLaDAModelLM"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_mask_predictor(tmp_path / "remote")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_mask_predictor(tmp_path / "missing")


def test_prompt_and_completion_encoding(tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    ids, attention = encode_prompts(tokenizer, ["1+2", "11+22"])
    assert attention.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]  # left padding, "\n" appended
    completions = encode_completions(tokenizer, ["A:3", "A:33"], 6)
    assert (completions[0, 3:] == tokenizer.eos_token_id).all()
    assert decode_completions(tokenizer, completions) == ["A:3", "A:33"]
    with pytest.raises(ValueError, match="gen_length"):
        encode_completions(tokenizer, ["1234567"], 6)


def test_answerer_shapes_and_registry(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "ckpt",
                        generation={"sampler": vars(SamplerConfig(gen_length=8, block_length=4, steps=4))})
    answerer = load_answerer(str(tmp_path / "ckpt"), max_new_tokens=64, temperature=1.0)
    assert answerer.sampler.gen_length == 8
    rows = load_arith_rows(3)
    greedy = answerer.answer(rows, 2, True)
    assert len(greedy) == 3 and all(len(s) == 2 and s[0] == s[1] for s in greedy)
    sampled = answerer.answer(rows, 2, False)
    assert len(sampled) == 3 and all(len(s) == 2 for s in sampled)

    from mmpo.eval.registry import resolve_benchmark

    benchmark = resolve_benchmark(ARITH_BENCHMARK)
    assert benchmark.modality == "dllm"
    loaded_rows = benchmark.loader()
    assert {"id", "problem", "answer"} <= set(loaded_rows[0])
    scores = benchmark.scorer(["A:" + loaded_rows[0]["answer"], "A:-1"], loaded_rows[:2])
    assert scores.tolist() == [1.0, 0.0]


def test_sampled_accuracy_counts_every_sample_in_batches(monkeypatch):
    """Scripted rollouts: per problem, sample k is right when k is even; 3 samples of 2 rows in batches of
    4 -> 4 right of 6; the generator reaches every rollout call and the train mode is restored."""
    import types

    import torch

    import mmpo.dllm.rollout as dllm_rollout

    calls = []

    def scripted(model, tokenizer, problems, config, *, generator=None, **_):
        calls.append((len(problems), generator))
        start = sum(n for n, _ in calls[:-1])
        texts = [f"\\boxed{{{'7' if (start + i) % 3 in (0, 2) else '1'}}}" for i in range(len(problems))]
        return types.SimpleNamespace(texts=texts)

    monkeypatch.setattr(dllm_rollout, "rollout", scripted)
    model = torch.nn.Linear(1, 1)
    rows = [{"problem": "a", "answer": "7"}, {"problem": "b", "answer": "7"}]
    generator = torch.Generator().manual_seed(0)
    accuracy = dllm_rollout.sampled_accuracy(model, None, rows, None, 3, generator=generator, batch_size=4)
    assert accuracy == pytest.approx(4 / 6)
    assert [n for n, _ in calls] == [4, 2] and all(g is generator for _, g in calls)
    assert model.training
