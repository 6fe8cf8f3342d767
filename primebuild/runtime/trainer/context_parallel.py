"""Context parallelism: one micro-batch's sequence split over the CP ranks, attention over all keys.

Both engines share the split (`make_shard`, `ContextShard`) and the k/v gather (`gather_sequence`): the
torchtitan engine's `titan_model.DocumentAttention` takes the shard as its mask. The transformers
attention function below (`context_parallel_attention`, with `ContextSplit`) is the hf engine's only,
kept for what torchtitan cannot run here: GLM-5 (builders/trainer_engine.py says why).

Split (load-balanced): the padded length T is cut into 2·cp chunks and CP rank i keeps chunks i and
2·cp−1−i, so under a causal mask every rank gets the same amount of attention work (a plain split
gives the last rank ~2·cp−1 times the first's).

Attention: each rank computes q, k, v for its own positions (RoPE at their global positions, passed as
`position_ids`), all-gathers k and v from the CP group and attends its queries over every key, causal
by global position. The all-gather is autograd-aware: its backward sums the key/value gradients of
every rank and returns each rank its own part. It runs as an attention function registered with
transformers' attention interface, so the HF decoder layers are untouched; on one rank, or without an
active split, it is plain SDPA. The split in flight is the model's `ContextSplit`, handed to its
attention modules, not a module global. A sparse attention's top-k `indices` (global positions, from an
indexer made global by sparse_attention.py) further restrict each query to those keys.

Micro-batches are packed documents (batch.py): a query sees the keys at or before it of its own
document, by global position and document id (`ContextShard.visible`). The padding a split needs forms a
document of its own, whose outputs are garbage that no loss reads.

Log-probs: the token at global position p+1 is predicted from position p, so a rank scores the targets
of its own positions (`ContextShard.targets`); every target is scored by exactly one rank, and the
loss sums and the gradient over the CP group equal the unsplit ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION_NAME = "primebuild_context_parallel"


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of a sequence of (padded) length `length`."""

    length: int
    positions: torch.Tensor  # [T_local] global positions this rank computes, ascending
    all_positions: torch.Tensor  # [T] the positions of every rank, in all-gather order
    group: dist.ProcessGroup
    documents: torch.Tensor  # [T] document id of every global position (batch.MicroBatch.document_ids)

    def visible(self, keys: torch.Tensor) -> torch.Tensor:
        """[T_local, len(keys)] bool: may each of this rank's positions attend to the global positions
        `keys`? Causal by global position, and only within its document."""
        causal = self.positions[:, None] >= keys[None, :]
        return causal & (self.documents[self.positions][:, None] == self.documents[keys][None, :])

    @property
    def targets(self) -> torch.Tensor:
        """Global positions whose token this rank scores: p + 1 for each of its positions p."""
        nxt = self.positions + 1
        return nxt[nxt < self.length]


def padded_length(length: int, cp: int) -> int:
    """Micro-batches are padded on the right to a multiple of 2·cp (two chunks per rank)."""
    chunks = 2 * cp
    return -(-length // chunks) * chunks


def shard_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Chunks `rank` and `2·cp−1−rank` of `length` (a multiple of 2·cp) positions."""
    chunk = length // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def make_shard(documents: torch.Tensor, cp: int, rank: int, group, device) -> ContextShard:
    """This rank's share of a packed row whose tokens belong to `documents` ([T], T a multiple of 2·cp)."""
    length = documents.numel()
    every = [shard_positions(length, cp, r) for r in range(cp)]
    return ContextShard(length, every[rank].to(device), torch.cat(every).to(device), group, documents.to(device))


class ContextSplit:
    """The split of the micro-batch being computed, shared by the attention modules and sparse indexers of
    one model (parallelize.apply_context_parallel hands it to them; Policy.forward sets it).

    Set, not entered as a context manager: with activation checkpointing the backward recomputes each
    layer's forward after Policy.forward has returned, and that recomputation must gather over the same
    split (the next forward replaces it)."""

    def __init__(self):
        self.shard: ContextShard | None = None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence axis (dim 2 of [B, H, T, D]); backward: sum over ranks, keep own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        ctx.rank, ctx.local = dist.get_rank(group), x.shape[2]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        # gloo has no reduce-scatter: all-reduce, then keep this rank's slice (2x the bytes of a
        # reduce-scatter; CP on GPUs would use NCCL's reduce_scatter_tensor here).
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.local:(ctx.rank + 1) * ctx.local].contiguous(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, T_local, D] of every rank of `group`, concatenated along T in rank order (the order of
    `ContextShard.all_positions`); its backward hands each rank the gradient of its own part, summed."""
    return _GatherSeq.apply(x, group)


def context_parallel_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               indices=None, **kwargs):
    """transformers attention function: [B, H, Tq, D] queries -> [B, Tq, H, D] outputs.

    `indices` ([B, Tq, k] global key positions, from a sparse-attention indexer: sparse_attention.py)
    restricts each query to those keys. The split comes from `module.context_split`
    (apply_context_parallel); a module without one attends unsplit."""
    split = getattr(module, "context_split", None)
    shard = None if split is None else split.shard
    groups = query.shape[1] // key.shape[1]
    if shard is None:
        if indices is not None:
            raise NotImplementedError("sparse attention indices without a context-parallel split")
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=attention_mask is None and query.shape[2] > 1,
                                             enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    key = gather_sequence(key, shard.group)
    value = gather_sequence(value, shard.group)
    visible = shard.visible(shard.all_positions)  # [Tq, T], in gathered order
    if indices is not None:
        chosen = torch.zeros(*indices.shape[:2], shard.length, dtype=torch.bool, device=indices.device)
        chosen = chosen.scatter_(-1, indices.long(), True)[:, :, shard.all_positions]  # in gathered order
        visible = (visible & chosen)[:, None]  # [B, 1, Tq, T]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, dropout_p=dropout, scale=scaling,
                                         enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make the attention function known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    return ATTENTION_NAME


def register_mask() -> None:
    """Have transformers build the (local) causal mask for this attention function too, as for SDPA: models
    that read the mask themselves need one (sparse_attention.py); the attention function ignores it under a
    split."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
