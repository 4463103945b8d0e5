"""Token log-probs and entropies without the full-vocabulary tensor of the whole batch.

A naive ``log_softmax(logits).gather(tokens)`` builds a second (B, T, V) tensor; for
Qwen-size vocabularies (V = 151936) that is ~2.5 GB per 4 x 1024 tokens in fp32. Here rows are
processed in chunks: only a (chunk, V) slab exists at a time, and the chosen token's
log-prob is ``logit[token] - logsumexp(logits)``. :func:`token_log_probs_from_hidden` goes one
step further and never builds the (B, T, V) logits either: it recomputes each chunk's logits
from the hidden states in the backward pass (a custom ``autograd.Function``), so forward and
backward peak memory are O(chunk x V) plus the parameters' own gradient.

Hand-written because torch has no fused linear + cross-entropy with this interface (Liger and
Cut-Cross-Entropy provide one as GPU kernels only).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024


def _check_chunk(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def _check_tokens(tokens: Tensor, vocab_size: int) -> None:
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), got min {int(tokens.min())} max {int(tokens.max())} "
            "(replace padding / ignore-index ids by a valid id and mask them out)"
        )


def _chunk_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    logits = logits.float()
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(logits: Tensor) -> Tensor:
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - lse)
    return lse.squeeze(-1) - (probs * logits).sum(-1)


def token_log_probs(logits: Tensor, tokens: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log softmax(logits)[token] per position, computed ``chunk_size`` rows at a time.

    Args:
        logits: ``(..., V)`` e.g. ``(batch, time, vocab)``; any float dtype (math in fp32).
        tokens: ``(...)`` integer ids in [0, V), same leading shape as ``logits``.
        chunk_size: rows (flattened leading positions) per chunk.

    Returns:
        ``(...)`` float32 log-probs; differentiable w.r.t. ``logits``.
    """
    _check_chunk(chunk_size)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits leading shape {tuple(logits.shape[:-1])} != tokens shape {tuple(tokens.shape)}")
    _check_tokens(tokens, logits.shape[-1])
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_tokens = tokens.reshape(-1)
    parts = [
        _chunk_log_probs(flat_logits[start:start + chunk_size], flat_tokens[start:start + chunk_size])
        for start in range(0, flat_tokens.numel(), chunk_size)
    ]
    out = torch.cat(parts) if parts else flat_logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(tokens.shape)


def entropy_from_logits(logits: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) z of each row, ``chunk_size`` rows at a time.

    With grad enabled each chunk is checkpointed, so backward also only holds one chunk's
    softmax at a time.

    Args:
        logits: ``(..., V)``.
        chunk_size: rows per chunk.

    Returns:
        ``(...)`` float32 entropies.
    """
    _check_chunk(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start:start + chunk_size]
        parts.append(checkpoint(_chunk_entropy, chunk, use_reentrant=False) if needs_grad else _chunk_entropy(chunk))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def _linear_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """(rows, V) float32 logits of one chunk; every step after the matmul is in place."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits.add_(bias)
    if logits.dtype != torch.float32:
        logits = logits.float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """sum_j a_ij b_ij per row via a batched matmul, without an (rows, V) product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(-1)).reshape(-1)


class _HiddenLogProbs(torch.autograd.Function):
    """Chunked linear + log-softmax gather (+ entropy) that recomputes chunk logits in backward.

    Peak extra memory per chunk is two (chunk, V) float32 buffers in forward and in backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, chunk_size, temperature, with_entropy):  # type: ignore[override]
        rows = hidden.shape[0]
        log_probs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk_size):
            stop = min(start + chunk_size, rows)
            shifted = _linear_logits(hidden[start:stop], weight, bias, temperature)
            row_max = shifted.max(dim=-1, keepdim=True).values
            shifted.sub_(row_max)  # z - max: exp cannot overflow
            chosen = shifted.gather(-1, tokens[start:stop].unsqueeze(-1)).squeeze(-1)
            probs = shifted.exp()
            sum_exp = probs.sum(-1)
            log_sum_exp = sum_exp.log()
            log_probs[start:stop] = chosen - log_sum_exp
            lse_all[start:stop] = log_sum_exp + row_max.squeeze(-1)
            if with_entropy:
                # H = lse(z) - sum p z, invariant to the shift by the row max
                probs.div_(sum_exp.unsqueeze(-1))
                entropy[start:stop] = log_sum_exp - _row_dot(probs, shifted)
            del shifted, probs
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), tokens, lse_all, entropy)
        ctx.has_bias = bias is not None
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(lse_all)
        return log_probs, entropy, lse_all

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_lse):  # type: ignore[override]
        hidden, weight, bias, tokens, lse_all, entropy = ctx.saved_tensors
        bias_t = bias if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse_all)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        rows = hidden.shape[0]
        for start in range(0, rows, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, rows)
            g_lp = grad_log_probs[start:stop].unsqueeze(-1)
            log_softmax = _linear_logits(hidden[start:stop], weight, bias_t, ctx.temperature)
            log_softmax.sub_(lse_all[start:stop].unsqueeze(-1))
            probs = log_softmax.exp()
            # d log p_y / dz = onehot(y) - p ;  dH / dz = -p (log p + H)
            # grad_z = onehot(y) g_lp - p (g_lp + g_H (log p + H)), built in place
            if use_entropy:
                g_ent = grad_entropy[start:stop].unsqueeze(-1)
                grad_logits = log_softmax.add_(entropy[start:stop].unsqueeze(-1)).mul_(g_ent).add_(g_lp)
                grad_logits.mul_(probs).neg_()
                del probs
            else:
                del log_softmax
                grad_logits = probs.mul_(-g_lp)
            grad_logits.scatter_add_(-1, tokens[start:stop].unsqueeze(-1), g_lp)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            if need_h:
                # in the weight's dtype: an fp32 copy of a bf16 weight would cost a weight-sized buffer
                grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                # accumulated in fp32 over chunks, cast to the weight's dtype once at the end
                grad_weight.addmm_(grad_logits.t(), hidden[start:stop].float())
            if need_b:
                grad_bias.add_(grad_logits.sum(0))
            del grad_logits
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def token_log_probs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    tokens: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``tokens`` under ``softmax((hidden @ W^T + b) / temperature)``, never building (B, T, V).

    Rows (flattened leading positions) are processed ``chunk_size`` at a time in forward and
    again in backward (the chunk logits are recomputed, not stored), so peak memory is
    O(chunk_size x V) plus the weight gradient.

    Args:
        hidden: ``(..., H)`` final hidden states, e.g. ``(batch, time, hidden)``.
        lm_head_weight: ``(V, H)`` output projection (``lm_head.weight``).
        tokens: ``(...)`` integer ids in [0, V).
        chunk_size: rows per chunk.
        bias: optional ``(V,)`` output bias.
        temperature: logits are divided by it (sampling temperature of the rollout).
        return_entropy: also return the per-position entropy from the same chunks.

    Returns:
        ``(...)`` float32 log-probs, and ``(...)`` float32 entropies if ``return_entropy``;
        both differentiable w.r.t. ``hidden``, ``lm_head_weight`` and ``bias``.
    """
    _check_chunk(chunk_size)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden leading shape {tuple(hidden.shape[:-1])} != tokens shape {tuple(tokens.shape)}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be (V, H={hidden.shape[-1]}), got {tuple(lm_head_weight.shape)}"
        )
    if bias is not None and bias.shape != (lm_head_weight.shape[0],):
        raise ValueError(f"bias must be (V={lm_head_weight.shape[0]},), got {tuple(bias.shape)}")
    _check_tokens(tokens, lm_head_weight.shape[0])
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_tokens = tokens.reshape(-1)
    log_probs, entropy, _ = _HiddenLogProbs.apply(
        flat_hidden, lm_head_weight, bias, flat_tokens, chunk_size, float(temperature), bool(return_entropy)
    )
    log_probs = log_probs.reshape(tokens.shape)
    if return_entropy:
        return log_probs, entropy.reshape(tokens.shape)
    return log_probs
