"""DeepSeek sparse attention (GLM-5's DSA) under context parallelism.

Without CP, a DSA layer's indexer scores every earlier key for each query and keeps the top `index_topk`;
attention then sees only those keys. Under CP a rank holds only its own positions, so two things must
become global for the result to equal one rank's:

1. the indexer's keys: each rank's indexer keys are all-gathered over the CP group and put back in
   global position order, and the indexer's mask becomes causal by global position, so every local query
   takes its top-k over all the keys it may see. The indexer runs without gradient (transformers computes
   it under no_grad, with or without CP), so a plain all-gather suffices. This is done by a forward
   pre-hook that hands transformers' own indexer a mask and a key "cache" (`update_indexer` is the one
   method the indexer calls on its cache), so its scoring code is the library's, unchanged.
2. the selection: the indices (global positions) reach context_parallel_attention as `indices`, which
   keeps only those keys of the gathered ones (context_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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


def _global_indexer_inputs(module, args, kwargs):
    """Forward pre-hook on an indexer: under an active split, global keys and a global causal mask."""
    shard = context_parallel.current_shard()
    if shard is None:
        return None
    hidden_states, q_resid, position_embeddings, _, position_ids = args
    visible = shard.positions[:, None] >= torch.arange(shard.length, device=shard.positions.device)[None, :]
    visible = visible.expand(hidden_states.shape[0], -1, -1)  # [B, T_local, T]
    return (hidden_states, q_resid, position_embeddings, visible, position_ids), \
        {**kwargs, "cache": _GlobalIndexerKeys(shard)}


def apply_sparse_attention_cp(hf: nn.Module) -> int:
    """Hook every DSA indexer of `hf` for CP; returns how many were hooked (0: not a sparse model)."""
    name = SPARSE_INDEXERS.get(getattr(hf.config, "model_type", None))
    if name is None:
        return 0
    indexers = [m for m in hf.modules() if type(m).__name__ == name]
    for indexer in indexers:
        indexer.register_forward_pre_hook(_global_indexer_inputs, with_kwargs=True)
    # The DSA attention slices the model's mask before calling the indexer, so the model must build one
    # (for an attention function transformers does not know, it builds none): the local causal mask,
    # which the hook then replaces by the global one and context_parallel_attention ignores.
    context_parallel.register_mask()
    return len(indexers)
