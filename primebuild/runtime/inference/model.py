"""A lean Qwen3 / Qwen3-MoE forward pass in plain torch, over the weights of an HF model folder.

Why not call the HF modules: on small models `generate` spends most of its time in Python module
overhead (norm modules, config look-ups, mask building), not in matmuls. Here one decoder layer is a
couple of dozen torch calls: fused QKV and gate/up projections (oneDNN-packed for calls with many
rows, see `Linear`), unit-length norms with the norm weights folded into the next matmul, a
precomputed RoPE table and attention over a preallocated KV cache (see kv_cache.py). The HF model code stays the reference that the
tests compare against, token for token and log-prob for log-prob.

Only inference: no autograd, no dropout. Supported: `model_type` qwen3 and qwen3_moe with default RoPE
and full attention (what every released Qwen3 checkpoint uses).

The weights come from weights.py (fused and norm-folded there, FP8 there too), the matmuls are
linear.py's, the architecture facts model_config.py's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from primebuild.kernels.fp8 import fake_quantize_activation

from .batch_invariant import in_row_blocks
from .model_config import ModelConfig
from .weights import LayerWeights, ModelWeights


class RotaryTable:
    """cos/sin for every position, computed once exactly as HF's default RoPE does (fp32, then cast)."""

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device):
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # HF rotates with cat(-x2, x1) * sin; we use roll(x) = cat(x2, x1) times cat(-sin, sin): same bits.
        half = d // 2
        sin = emb.sin()
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        # [max_len, 2, D]: a decode step gathers cos and sin of every row's position in one call.
        self.cos_sin = torch.stack([emb.cos(), sin_signed], dim=1).to(device=device, dtype=dtype)
        self.cos = self.cos_sin[:, 0]
        self.sin_signed = self.cos_sin[:, 1]


@functools.lru_cache(maxsize=64)
def _norm_floor(square: float, device: torch.device) -> torch.Tensor:
    """sqrt(n * eps) as a tensor, for `torch.hypot` (which takes no Python scalar)."""
    return torch.tensor(square**0.5, dtype=torch.float32, device=device)


def _unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(|x|^2 + n * eps) over the last axis (size n): RMSNorm divided by sqrt(n). In fp32 it
    is x / hypot(|x|, sqrt(n * eps)), 3 calls where F.rms_norm takes 7 kernels on CPU (and half the
    time of vecdot + add + rsqrt + unsqueeze + mul). The sqrt(n) lives in the weights (`norm_weight`).
    Half-precision inputs are reduced in fp32, as HF's Qwen3RMSNorm does."""
    if x.dtype != torch.float32:
        wide = x.float()
        return (wide * torch.linalg.vecdot(wide, wide).add_(x.shape[-1] * eps).rsqrt_()[..., None]).to(
            x.dtype
        )
    floor = _norm_floor(x.shape[-1] * eps, x.device)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).hypot_(floor)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def _fp8_matmul(weight, reference: bool):
    """An FP8 expert weight's matmul over rows: the fp32 product with the dequantised weight (reference), or
    the block-scaled GEMM."""
    return (lambda rows: rows @ weight.dequantised.T) if reference else weight.matmul


class Qwen3Forward:
    """Forward passes over one set of weights; `weights` may be swapped between calls.

    The decode step is written for the CPU, where a tiny model's step costs about as much in per-call
    overhead (a few microseconds per torch call) as in arithmetic: every call it makes is counted, and
    shapes are arranged so that no call hides a copy (see `decode`).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, rope: RotaryTable, *,
                 batch_invariant: bool = False):
        self.config = config
        self.weights = weights
        self.rope = rope
        # Every matmul on fixed row blocks, attention and prefill one sequence at a time: a sequence's
        # numbers do not depend on its batch (batch_invariant.py).
        self.batch_invariant = batch_invariant
        c = config
        self._split = ((c.num_heads + c.num_kv_heads) * c.head_dim, c.num_kv_heads * c.head_dim)
        self._heads = (c.num_heads, c.num_kv_heads)
        device = rope.cos_sin.device
        self._arange = torch.arange(rope.cos_sin.shape[0], device=device)
        self._minus_inf = torch.tensor(float("-inf"), dtype=rope.cos_sin.dtype, device=device)
        self._zero = torch.zeros((), dtype=rope.cos_sin.dtype, device=device)

    def _matmul(self, linear, x: torch.Tensor) -> torch.Tensor:
        """linear(x) for x [rows, in]: a `Linear`, or any callable taking rows first."""
        return in_row_blocks(linear, x) if self.batch_invariant else linear(x)

    def _matmul_add(self, linear, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + linear(x), the add fused into the matmul."""
        return in_row_blocks(linear.add_to, residual, x) if self.batch_invariant else linear.add_to(residual, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight and its sqrt(hidden) (both folded into the next matmul)."""
        return _unit(x, self.config.rms_norm_eps)

    def _input_norm(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        normed = self._norm(x)
        return normed if layer.input_scale is None else normed * layer.input_scale

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input [N, hidden] -> q (pre-scaled) and k with q/k norm and RoPE applied, [N, heads, D]
        each, and v [N, kv_heads, D] (a view into the projection's output)."""
        c = self.config
        qk, v = self._matmul(layer.qkv, x).split_with_sizes(self._split, dim=-1)
        qk = _unit(qk.view(x.shape[0], -1, c.head_dim), c.rms_norm_eps)
        q, k = _rotate(qk * layer.qk_norm, cos, sin).split_with_sizes(self._heads, dim=-2)
        return q, k, v.view(x.shape[0], c.num_kv_heads, c.head_dim)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, routed: list | None) -> torch.Tensor:
        """x + MLP(norm(x)) for 2-D x; a dense MLP's down projection carries the residual add."""
        normed = self._norm(x)
        if layer.post_scale is not None:  # FP8: the norm's weight is not folded into quantised weights
            normed = normed * layer.post_scale
        if layer.router is None:
            gate, up = self._matmul(layer.gate_up, normed).chunk(2, dim=-1)
            return self._matmul_add(layer.down, x, F.silu(gate).mul_(up))
        return x + self._moe(layer, normed, routed)

    def _moe(self, layer: LayerWeights, flat: torch.Tensor, routed: list | None) -> torch.Tensor:
        c = self.config
        router_logits = self._matmul(functools.partial(F.linear, weight=layer.router), flat)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(flat.dtype)
        if routed is not None:
            routed.append(top_experts)
        # Group (token, slot) pairs by expert so that each expert runs one matmul over its tokens.
        by_expert = top_experts.flatten()
        order = torch.argsort(by_expert, stable=True)
        counts = torch.bincount(by_expert, minlength=c.num_experts).tolist()
        token_of = order // c.num_experts_per_tok
        weight_of = top_weights.flatten()[order]
        if layer.experts_fp8 is not None:
            return self._moe_fp8(layer, flat, counts, token_of, weight_of)
        out = torch.zeros_like(flat)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate_up = functools.partial(F.linear, weight=layer.experts_gate_up[expert])
            gate, up = self._matmul(gate_up, flat[tokens]).chunk(2, dim=-1)
            y = self._matmul(functools.partial(F.linear, weight=layer.experts_down[expert]), F.silu(gate) * up)
            out.index_add_(0, tokens, y * weight_of[start : start + count, None])
            start += count
        return out

    def _moe_fp8(self, layer: LayerWeights, flat: torch.Tensor, counts: list[int], token_of: torch.Tensor,
                 weight_of: torch.Tensor) -> torch.Tensor:
        """The experts with FP8 weights. Quantisation is per token and 1x128 tile, so the tokens' inputs
        are quantised once for every expert, and on the reference path the inner activations of all
        experts at once (3 quantisations per layer instead of 1 + 2 per expert)."""
        gate_up, down = layer.experts_fp8
        reference = not gate_up[0].fast
        source = fake_quantize_activation(flat.float()) if reference else flat  # reference: fp32 sums
        inner, ranges, start = [], [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = token_of[start : start + count]
                w = gate_up[expert]
                g, u = self._matmul(_fp8_matmul(w, reference), source[rows]).chunk(2, dim=-1)
                inner.append(F.silu(g) * u)
                ranges.append((expert, start, count))
            start += count
        if reference:
            inner = fake_quantize_activation(torch.cat(inner)).split([n for _, _, n in ranges])
        out = torch.zeros_like(flat)
        for h, (expert, start, count) in zip(inner, ranges, strict=True):
            w = down[expert]
            y = self._matmul(_fp8_matmul(w, reference), h).to(flat.dtype)
            out.index_add_(0, token_of[start : start + count], y * weight_of[start : start + count, None])
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._matmul(self.weights.lm_head, self._norm(hidden)).float()

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache,
        routed: list | None = None,
    ) -> torch.Tensor:
        """Right-padded prompts [B, T] from position 0 into cache `slots`; logits [B, V] at each last token.

        Padding sits after the real tokens, so causal attention never lets a real token see it; the
        padding's K/V written beyond a sequence's length is masked out later and then overwritten.
        Matmuls run over the flattened [B * T, hidden] rows.
        """
        if self.batch_invariant:
            return self._prefill_each(tokens, lengths, slots, cache, routed)
        return self._prefill_batch(tokens, lengths, slots, cache, routed)

    def _prefill_each(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache,
                      routed: list | None) -> torch.Tensor:
        """`prefill` one prompt at a time, each at its own length (no padding): its sums then do not depend
        on the prompts beside it. Routes are padded back to [B, T, k] as the batched prefill gives them."""
        steps = tokens.shape[1]
        logits, routes = [], []
        for row, length in enumerate(lengths.tolist()):
            own = None if routed is None else []
            logits.append(self._prefill_batch(tokens[row:row + 1, :length], lengths[row:row + 1],
                                              slots[row:row + 1], cache, own))
            routes.append(own)
        if routed is not None:
            routed[:] = [torch.cat([F.pad(own[layer], (0, 0, 0, steps - own[layer].shape[1])) for own in routes])
                         for layer in range(len(routes[0]))]
        return torch.cat(logits)

    def _prefill_batch(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache,
                       routed: list | None) -> torch.Tensor:
        c = self.config
        w = self.weights
        batch, steps = tokens.shape
        rows = batch * steps
        cos = self.rope.cos[:steps].repeat(batch, 1)[:, None, :]  # [B * T, 1, D]
        sin = self.rope.sin_signed[:steps].repeat(batch, 1)[:, None, :]
        x = F.embedding(tokens.flatten(), w.embed)
        for index, layer in enumerate(w.layers):
            q, k, v = self._qkv(layer, self._input_norm(layer, x), cos, sin)  # [B * T, heads, D]
            q = q.view(batch, steps, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            cache.k[index][slots, :, :steps] = k
            cache.v[index][slots, :, :steps] = v
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=1.0, enable_gqa=c.num_kv_heads != c.num_heads
            )
            x = self._matmul_add(layer.o_proj, x, attn.transpose(1, 2).reshape(rows, -1))
            x = self._mlp(layer, x, routed)
        if routed is not None:
            routed[:] = [r.view(batch, steps, -1) for r in routed]
        last = x.view(batch, steps, -1)[torch.arange(batch, device=x.device), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs [T - 1] of tokens[1:], each given the ones before it: one causal pass over a sequence
        [T], no KV cache and no temperature (the model's own distribution, as vLLM's prompt_logprobs). A
        teacher scores a student's sampled tokens with it (on-policy distillation)."""
        c = self.config
        steps = tokens.shape[0]
        cos, sin = self.rope.cos[:steps][:, None, :], self.rope.sin_signed[:steps][:, None, :]
        x = F.embedding(tokens, self.weights.embed)
        for layer in self.weights.layers:
            q, k, v = self._qkv(layer, self._input_norm(layer, x), cos, sin)
            q = q.view(1, steps, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(1, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(1, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=1.0, enable_gqa=c.num_kv_heads != c.num_heads
            )
            x = self._matmul_add(layer.o_proj, x, attn.transpose(1, 2).reshape(steps, -1))
            x = self._mlp(layer, x, None)
        logprobs = torch.log_softmax(self._logits(x[:-1]), dim=-1)
        return logprobs.gather(1, tokens[1:, None]).squeeze(1)

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache, max_len: int, routed: list | None = None
    ) -> torch.Tensor:
        """One new token per sequence; sequence b lives in cache slot b (the cache keeps them packed).

        Per layer: norm, fused QKV matmul, q/k norm and RoPE (4 calls), two K/V row writes, attention,
        and the output projection and down projection each carry their residual add.
        """
        c = self.config
        w = self.weights
        batch = tokens.shape[0]
        cos, sin = self.rope.cos_sin.index_select(0, positions).unsqueeze(2).unbind(1)  # [B, 1, D] each
        new_rows = (cache.row_index(batch, positions),)  # where each layer's new K/V rows go
        # Query heads that share a KV head become the "query length" axis: GQA without repeating K/V.
        groups = c.num_heads // c.num_kv_heads
        window = (batch, c.num_kv_heads, max_len, c.head_dim)
        own_lengths = (positions + 1).tolist() if self.batch_invariant else None
        if batch > 1 and not self.batch_invariant:
            # Attention runs as 3-D batched matmuls over [batch * kv_heads] (no 4-D matmul wrapper).
            # Positions beyond a row's own length hold stale or padding K/V: an additive -inf bias,
            # built once per step for all layers, lets the score matmul apply the mask itself.
            flat_batch = batch * c.num_kv_heads
            flat_window, flat_stride = (flat_batch, max_len, c.head_dim), cache.k[0].stride()[1:]
            bias = torch.where(self._arange[:max_len] > positions.view(batch, 1), self._minus_inf, self._zero)
            bias = bias.view(batch, 1, max_len).expand(batch, c.num_heads, max_len)
            bias = bias.reshape(flat_batch, groups, max_len)
        x = w.embed.index_select(0, tokens)
        for index, layer in enumerate(w.layers):
            q, k, v = self._qkv(layer, self._input_norm(layer, x), cos, sin)  # [B, heads, D]
            cache.k_rows[index].index_put_(new_rows, k)
            cache.v_rows[index].index_put_(new_rows, v)
            keys, values = cache.k[index], cache.v[index]
            if own_lengths is not None:  # batch invariant: each sequence over its own cache window
                q = q.view(batch, c.num_kv_heads, groups, c.head_dim)
                attn = torch.cat([F.scaled_dot_product_attention(q[b:b + 1], keys[b:b + 1, :, :length],
                                                                 values[b:b + 1, :, :length], scale=1.0)
                                  for b, length in enumerate(own_lengths)])
            elif batch == 1:  # SDPA's fused kernel wins for one sequence (nothing to mask)
                q = q.view(batch, c.num_kv_heads, groups, c.head_dim)
                # keys[:1, :, :max_len] (likewise values), in one call instead of a parsed index.
                keys, values = keys.as_strided(window, keys.stride()), values.as_strided(window, keys.stride())
                attn = F.scaled_dot_product_attention(q, keys, values, scale=1.0)
            else:  # for many short rows, two batched matmuls beat SDPA's per-row overhead on CPU
                # keys[:batch, :, :max_len] as [batch * kv_heads, max_len, D]: slots and heads are
                # adjacent in the cache, so this is a view.
                keys, values = keys.as_strided(flat_window, flat_stride), values.as_strided(flat_window, flat_stride)
                q = q.reshape(flat_batch, groups, c.head_dim)  # a copy: q is a slice of the q|k rows
                scores = torch.baddbmm(bias, q, keys.transpose(1, 2))
                attn = torch.bmm(torch._softmax(scores, -1, False), values)
            x = self._matmul_add(layer.o_proj, x, attn.reshape(batch, -1))
            x = self._mlp(layer, x, routed)
        return self._logits(x)
