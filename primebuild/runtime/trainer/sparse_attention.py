"""DeepSeek sparse attention (GLM-5's DSA) under context parallelism.

Without CP, a DSA layer's indexer scores every earlier key for each query and keeps the top `index_topk`;
attention then sees only those keys. Under CP a rank holds only its own positions, so two things must
become global for the result to equal one rank's:

1. the indexer's keys: each rank's indexer keys are all-gathered over the CP group and put back in
   global position order, and the indexer's mask becomes causal by global position (within each packed document), so every local query
   takes its top-k over all the keys it may see. The indexer runs without gradient (transformers computes
   it under no_grad, with or without CP), so a plain all-gather suffices. This is done by a forward
   pre-hook that hands transformers' own indexer a mask and a key "cache" (`update_indexer` is the one
   method the indexer calls on its cache), so its scoring code is the library's, unchanged.
2. the selection: the indices (global positions) reach context_parallel_attention as `indices`, which
   keeps only those keys of the gathered ones (context_parallel.py).

With or without CP, the trainer's indexers score a chunk of queries at a time (`chunked_index_topk`):
transformers' indexer holds the float32 scores of every query against every key and head at once, which
for GLM-5 at long sequences is hundreds of GiB per layer. The chunks give the same indices.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from primebuild.builders.memory import index_query_chunk

from . import context_parallel

# model_type -> the class name of its indexer module
SPARSE_INDEXERS = {"glm_moe_dsa": "GlmMoeDsaIndexer"}


class _GlobalIndexerKeys:
    """Stands in for the KV cache the indexer reads its keys from: returns every CP rank's keys."""

    def __init__(self, shard: context_parallel.ContextShard):
        self.shard = shard

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """[B, T_local, D] keys of this rank -> [B, T, D] keys of every position, in position order."""
        parts = [torch.empty_like(keys) for _ in range(dist.get_world_size(self.shard.group))]
        dist.all_gather(parts, keys.contiguous(), group=self.shard.group)
        gathered = torch.cat(parts, dim=1)
        return torch.empty_like(gathered).index_copy_(1, self.shard.all_positions, gathered)


def _global_indexer_inputs(split: context_parallel.ContextSplit, module, args, kwargs):
    """Forward pre-hook on an indexer: under an active split, global keys and a global causal mask."""
    shard = split.shard
    if shard is None:
        return None
    hidden_states, q_resid, position_embeddings, _, position_ids = args
    visible = shard.visible(torch.arange(shard.length, device=shard.positions.device))
    visible = visible.expand(hidden_states.shape[0], -1, -1)  # [B, T_local, T]
    return (hidden_states, q_resid, position_embeddings, visible, position_ids), \
        {**kwargs, "cache": _GlobalIndexerKeys(shard)}


@torch.no_grad()
def chunked_index_topk(indexer: nn.Module, hidden_states, q_resid, position_embeddings, attention_mask,
                       position_ids=None, cache=None, query_chunk: int | None = None) -> torch.Tensor:
    """transformers' GlmMoeDsaIndexer.forward, query chunk by query chunk: int32 [B, S, topk] key indices.

    Same modules and the same float32 operations per query row as the library's, so the same indices;
    the scores are scaled, rectified and masked in place so one chunk's [B, C, H, T] scores live once."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    batch, seq_len, _ = hidden_states.shape
    heads, dim, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch, seq_len, heads, dim)
    q_rot, q_pass = torch.split(q, [rope, dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
    k_rot, k_pass = torch.split(k, [rope, dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)  # interleaved, as GLM-5
    q = torch.cat([q_rot, q_pass], dim=-1).float()  # [B, S, H, D]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
    if cache is not None:  # under CP: every rank's keys (_GlobalIndexerKeys)
        k = cache.update_indexer(k, indexer.layer_idx)
    keys_t = k.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, T]
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * (heads**-0.5)
    topk = min(indexer.index_topk, keys_t.shape[-1])
    chunk = query_chunk or index_query_chunk(batch, heads, keys_t.shape[-1])
    out = torch.empty(batch, seq_len, topk, dtype=torch.int32, device=hidden_states.device)
    for start in range(0, seq_len, chunk):
        rows = slice(start, start + chunk)
        scores = torch.matmul(q[:, rows], keys_t)  # [B, C, H, T]
        scores.mul_(indexer.softmax_scale).relu_()
        index_scores = torch.matmul(weights[:, rows].unsqueeze(-2), scores).squeeze(-2)  # [B, C, T]
        del scores
        mask = attention_mask[:, rows] if attention_mask.shape[1] > 1 else attention_mask
        if mask.dtype == torch.bool:  # causality (and padding): masked keys are never chosen
            index_scores.masked_fill_(~mask, float("-inf"))
        else:
            index_scores.add_(mask)
        out[:, rows] = index_scores.topk(topk, dim=-1).indices
    return out


def apply_chunked_indexer(hf: nn.Module, query_chunk: int | None = None) -> int:
    """Have every DSA indexer of `hf` score by query chunks; returns how many (0: not a sparse model)."""
    name = SPARSE_INDEXERS.get(getattr(hf.config, "model_type", None))
    indexers = [m for m in hf.modules() if type(m).__name__ == name] if name else []
    for indexer in indexers:
        indexer.forward = functools.partial(chunked_index_topk, indexer, query_chunk=query_chunk)
    return len(indexers)


def apply_sparse_attention_cp(hf: nn.Module, split: context_parallel.ContextSplit) -> int:
    """Hook every DSA indexer of `hf` for CP over `split`; returns how many were hooked (0: not a sparse
    model)."""
    name = SPARSE_INDEXERS.get(getattr(hf.config, "model_type", None))
    if name is None:
        return 0
    indexers = [m for m in hf.modules() if type(m).__name__ == name]
    for indexer in indexers:
        indexer.register_forward_pre_hook(functools.partial(_global_indexer_inputs, split), with_kwargs=True)
    # The DSA attention slices the model's mask before calling the indexer, so the model must build one
    # (for an attention function transformers does not know, it builds none): the local causal mask,
    # which the hook then replaces by the global one and context_parallel_attention ignores.
    context_parallel.register_mask()
    return len(indexers)
