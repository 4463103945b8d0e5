"""Chunked log-probs and entropies equal the naive full-vocabulary computation (values and grads)."""

import pytest
import torch

from mmpo.core import entropy_from_logits, token_log_probs, token_log_probs_from_hidden


def _naive_log_probs(logits, tokens):
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits):
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])
def test_token_log_probs_matches_naive(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 50, generator=gen)).requires_grad_(True)
    tokens = torch.randint(0, 50, (3, 5), generator=gen)
    out = token_log_probs(logits, tokens, chunk_size=chunk_size)
    ref = _naive_log_probs(logits, tokens)
    assert out.shape == (3, 5) and torch.allclose(out, ref, atol=1e-5)
    weights = torch.randn(3, 5, generator=gen)
    (g,) = torch.autograd.grad((out * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert torch.allclose(g, g_ref, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [2, 15])
def test_entropy_from_logits_matches_naive(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(3, 5, 40, generator=gen)).requires_grad_(True)
    out = entropy_from_logits(logits, chunk_size=chunk_size)
    ref = _naive_entropy(logits)
    assert torch.allclose(out, ref, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(g, g_ref, atol=1e-5)
    # hand value: uniform logits over V entries have entropy log V
    assert entropy_from_logits(torch.zeros(1, 40)).item() == pytest.approx(torch.log(torch.tensor(40.0)).item())
    with torch.no_grad():
        assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk_size), ref, atol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_hidden_log_probs_and_entropy_match_naive(use_bias, temperature, chunk_size):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 7, 16, generator=gen).requires_grad_(True)
    weight = (0.5 * torch.randn(33, 16, generator=gen)).requires_grad_(True)
    bias = torch.randn(33, generator=gen).requires_grad_(True) if use_bias else None
    tokens = torch.randint(0, 33, (2, 7), generator=gen)
    lp, ent = token_log_probs_from_hidden(
        hidden, weight, tokens, chunk_size=chunk_size, bias=bias, temperature=temperature, return_entropy=True
    )
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits / temperature
    lp_ref, ent_ref = _naive_log_probs(logits, tokens), _naive_entropy(logits)
    assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-5)
    w_lp, w_ent = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    inputs = [hidden, weight] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), inputs)
    grads_ref = torch.autograd.grad((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum(), inputs)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g, g_ref, atol=1e-5)


def test_hidden_log_probs_only_and_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_(True)
    tokens = torch.randint(0, 6, (5,), generator=gen)
    out = token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=2)
    assert out.shape == (5,) and out.dtype == torch.float32

    def both(h, w, b):
        lp, ent = token_log_probs_from_hidden(h, w, tokens, chunk_size=2, bias=b, return_entropy=True)
        return lp.double(), ent.double()

    # float32 internals -> loose tolerances; this still checks the hand-written backward analytically
    assert torch.autograd.gradcheck(both, (hidden, weight, bias), eps=1e-3, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_hidden_log_probs_without_entropy_match_naive_gradients(temperature):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 12, generator=gen).requires_grad_(True)
    weight = torch.randn(29, 12, generator=gen).requires_grad_(True)
    tokens = torch.randint(0, 29, (3, 4), generator=gen)
    lp = token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=5, temperature=temperature)
    lp_ref = _naive_log_probs((hidden @ weight.t()) / temperature, tokens)
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    w = torch.randn(3, 4, generator=gen)
    grads = torch.autograd.grad((lp * w).sum(), [hidden, weight])
    grads_ref = torch.autograd.grad((lp_ref * w).sum(), [hidden, weight])
    for g, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g, g_ref, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(4, 8, generator=gen).requires_grad_(True)
    weight = torch.randn(10, 8, generator=gen)  # frozen
    tokens = torch.randint(0, 10, (4,), generator=gen)
    token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=3).sum().backward()
    hidden_ref = hidden.detach().clone().requires_grad_(True)
    _naive_log_probs(hidden_ref @ weight.t(), tokens).sum().backward()
    assert weight.grad is None
    assert torch.allclose(hidden.grad, hidden_ref.grad, atol=1e-5)


def test_bad_inputs_are_named():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 5\), got min -100"):
        token_log_probs(logits, torch.tensor([[0, 1, -100], [0, 0, 0]]))
    with pytest.raises(ValueError, match="leading shape"):
        token_log_probs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        token_log_probs(logits, torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match=r"lm_head_weight must be \(V, H=4\)"):
        token_log_probs_from_hidden(torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be positive"):
        token_log_probs_from_hidden(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                                    temperature=0.0)


def test_hidden_log_probs_bf16_inputs_give_fp32_outputs_and_input_dtype_grads():
    gen = torch.Generator().manual_seed(6)
    hidden32 = torch.randn(2, 5, 16, generator=gen)
    weight32 = 0.3 * torch.randn(40, 16, generator=gen)
    tokens = torch.randint(0, 40, (2, 5), generator=gen)
    hidden = hidden32.bfloat16().requires_grad_(True)
    weight = weight32.bfloat16().requires_grad_(True)
    lp = token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=3)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # against the fp32 computation on the same (bf16-rounded) inputs, at bf16 tolerance
    h_ref = hidden.detach().float().requires_grad_(True)
    w_ref = weight.detach().float().requires_grad_(True)
    ref = _naive_log_probs(h_ref @ w_ref.t(), tokens)
    ref.sum().backward()
    assert torch.allclose(lp, ref, atol=3e-2)
    assert torch.allclose(hidden.grad.float(), h_ref.grad, atol=5e-2)
    assert torch.allclose(weight.grad.float(), w_ref.grad, atol=5e-2)
