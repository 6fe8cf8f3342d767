"""Log-probs of target tokens without materialising the whole [tokens x vocab] logits.

An RL trainer needs, per token, log softmax(h @ W.T / T)[target] and (as a metric) the entropy. The
plain way builds fp32 logits for every token of a micro-batch: 131,072 tokens x 154,880 vocab x 4 bytes
= 81 GB, and autograd keeps them for the backward. Here rows are taken `chunk` tokens at a time, in
the forward and again in the backward (the logits of a chunk are recomputed, never stored), so at
most `chunk x vocab` fp32 values exist at once; what is kept for the backward is the input (hidden
states, weight) and one fp32 log-normaliser per token.

Gradient of log p(y) with respect to the logits z (divided by T): (onehot(y) - softmax(z)) / T, times
the incoming gradient; then dh = g @ W and dW = g.T @ h, accumulated over chunks in fp32.

The matmul runs in the hidden states' dtype (bf16 under mixed precision, as the model's own head
would) and everything after it in fp32 (float64 for float64 inputs, so gradcheck can check it).
"""

from __future__ import annotations

import torch
from torch import Tensor


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                           chunk: int) -> tuple[Tensor, Tensor]:
    """hidden [N, H], weight [V, H], targets [N] -> (log-probs [N] with gradient, entropy [N] without),
    both in fp32 (float64 for float64 inputs)."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"want hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if chunk < 1 or temperature <= 0:
        raise ValueError(f"chunk must be >= 1 and temperature > 0, got {chunk}, {temperature}")
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (bf16 logits would round the log-probs away); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h: Tensor, weight: Tensor, temperature: float) -> Tensor:
    return (h @ weight.to(h.dtype).T).to(_acc(h.dtype)) / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=_acc(hidden.dtype), device=hidden.device)
        entropy = torch.empty_like(logprobs)
        log_norm = torch.empty_like(logprobs)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            z = _logits(hidden[rows], weight, temperature)
            lse = torch.logsumexp(z, dim=-1)
            log_norm[rows] = lse
            logprobs[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse
            entropy[rows] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, log_norm = ctx.saved_tensors
        t, n = ctx.temperature, hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=_acc(weight.dtype), device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            z = _logits(hidden[rows], weight, t)
            g_out = grad_logprobs[rows].to(z.dtype)
            g = torch.exp(z - log_norm[rows, None]).mul_(-g_out[:, None])
            g.scatter_add_(-1, targets[rows, None], g_out[:, None])
            g.div_(t)
            if grad_hidden is not None:
                grad_hidden[rows] = (g.to(hidden.dtype) @ weight.to(hidden.dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += g.T @ hidden[rows].to(g.dtype)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None
