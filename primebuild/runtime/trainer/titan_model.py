"""torchtitan's Qwen3 (dense and MoE) built from a Hugging Face config: the trainer's model when the plan
chooses the `torchtitan` engine (primebuild/builders/trainer_engine.py).

The blocks, attention, RoPE, feed-forward and MoE (router, grouped experts) are torchtitan's own modules,
assembled with its config helpers from the numbers of the checkpoint's config.json; weights come and go
in Hugging Face naming through torchtitan's Qwen3 state-dict adapter (titan_policy.py).

Attention: torchtitan's language models take a block-causal *document* mask derived from the positions
(0 where a packed document starts). On a GPU that is its FlexAttention with the BlockMask it builds.
FlexAttention has no backward on CPU (torch 2.13), so on a CPU the inner attention is
`DocumentAttention`: the same block-causal document mask, computed document by document through
scaled_dot_product_attention (a dense mask over a packed row would cost its length squared). Only the
inner attention differs; projections, norms, RoPE and the rest are torchtitan's either way.

Context parallelism (cp > 1) runs `DocumentAttention` on GPUs too, with a `ContextShard` as its mask:
each rank holds the head-and-tail balanced slice of the packed row that the hf engine's CP uses
(context_parallel.py), all-gathers k and v over its CP group and attends its queries to the keys of
its own document at or before it, by global position. Not torch's `context_parallel` (which torchtitan
applies): its ring SDPA takes no mask but `is_causal` ("attn_bias is not supported yet", torch 2.13),
so packed documents would attend across their boundaries, and its FlexAttention path has no backward
on CPU. The gathered mask is dense, [T_local, T] per micro-batch: the price of one code path that is
exact on both devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import (
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.protocols.module import Module

from primebuild.errors import UserError

from .context_parallel import ContextShard, gather_sequence

# model_type -> what torchtitan builds for it here (keep equal to builders/trainer_engine.py's TITAN_MODELS)
TITAN_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class DocumentLayout:
    """Where each packed document's tokens sit in the flattened [B*T] row(s): `index` [D, L] (a document
    per row, padded to the longest with index 0) and `real` [D, L] (False on that padding).

    The CPU attention gathers q, k and v into these [D, L] rows and runs causal attention per document, so
    it costs D x L^2, not the (B*T)^2 of a dense mask over the packed row; projections, norms and the
    feed-forward never see the padding. A document starts where its position is 0 (batch.py)."""

    index: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> DocumentLayout:
        flat = position_ids.reshape(-1)
        starts = (flat == 0).nonzero().flatten()
        if starts.numel() == 0 or starts[0] != 0:
            raise ValueError("a packed row must start a document: position 0 first")
        lengths = torch.diff(starts, append=starts.new_tensor([flat.numel()]))
        offsets = torch.arange(int(lengths.max()), device=flat.device)
        real = offsets[None, :] < lengths[:, None]
        return cls(torch.where(real, starts[:, None] + offsets[None, :], 0), real)


class DocumentAttention(Module):
    """Inner attention over (B, L, N, H) q/k/v: causal attention within each document, through
    scaled_dot_product_attention. The mask is a `DocumentLayout` (the whole row on this rank: CPU) or a
    `ContextShard` (this rank's slice of it under context parallelism: CPU and GPU)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None):
        super().__init__()

    # q/k/v are named as torchtitan's attentions name them: its sharding configs (TP, CP) address them so
    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: DocumentLayout, scale: float | None = None,
                enable_gqa: bool = False, **_) -> torch.Tensor:
        if isinstance(attention_masks, ContextShard):
            return _context_parallel_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale, enable_gqa)
        layout = attention_masks
        b, t = q_BLNH.shape[:2]

        def per_document(x: torch.Tensor) -> torch.Tensor:  # (B, T, N, H) -> (D, N, L, H)
            return x.reshape(b * t, *x.shape[2:])[layout.index].transpose(1, 2)

        out = F.scaled_dot_product_attention(per_document(q_BLNH), per_document(k_BLNH), per_document(v_BLNH),
                                             is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)
        packed = out.new_empty(b * t, *out.shape[2:])  # (B*T, N, H)
        packed[layout.index[layout.real]] = out[layout.real]
        return packed.view(b, t, *out.shape[2:])


def _context_parallel_attention(q_BLNH, k_BLNH, v_BLNH, shard: ContextShard, scale: float | None,
                                enable_gqa: bool) -> torch.Tensor:
    """This rank's queries over the keys of every CP rank, masked by document and global position."""
    q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
    k, v = gather_sequence(k, shard.group), gather_sequence(v, shard.group)
    if enable_gqa and k.shape[1] != q.shape[1]:
        # heads expanded here, not through enable_gqa: with a mask the fused CUDA kernel is the memory-efficient
        # one, and whether it takes enable_gqa was not checked on a GPU here; where it does not, SDPA falls
        # back to the math kernel and its full score matrix. The same numbers either way (CPU tests).
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    visible = shard.visible(shard.all_positions)  # [L_local, L], keys in gathered order
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return out.transpose(1, 2)


class ExactGroupedExperts(GroupedExperts):
    """torchtitan's grouped experts (same parameters, names and sharding), computed in the parameters'
    own dtype, one expert's rows at a time: torchtitan's computes in bf16 whatever the model's precision,
    which an fp32 trainer would not be (its log-probs drifted ~1e-4 from the fp32 engines'; measured).
    Chosen for fp32 training only (`titan_config(exact_experts=True)`); bf16 keeps torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    @staticmethod
    def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T for one expert's weight `w` (titan_fp8.Fp8GroupedExperts: block-scaled FP8)."""
        return x @ w.T

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        ends = torch.cumsum(num_tokens_per_expert_E, dim=0).tolist()
        out = x_RD.new_zeros(x_RD.shape[0], w2.shape[1])
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                x = x_RD[start:end]
                out[start:end] = self.matmul(F.silu(self.matmul(x, w1[e])) * self.matmul(x, w3[e]), w2[e])
            start = end
        return out


def _rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"{hf_config.model_type}: scaled RoPE ({rope['rope_type']}) "
                        "is not built for the torchtitan engine here", hint="set trainer.engine: hf")
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def titan_config(hf_config, flex_attention: bool, exact_experts: bool = False):
    """torchtitan's Qwen3Model.Config for a Hugging Face Qwen3 / Qwen3-MoE config. `flex_attention`:
    torchtitan's FlexAttention (a GPU without CP), else DocumentAttention; `exact_experts`: MoE experts in
    the parameters' dtype (ExactGroupedExperts), for fp32 training."""
    c = hf_config
    if c.model_type not in TITAN_MODEL_TYPES:
        raise UserError(f"model_type {c.model_type!r}: the torchtitan engine builds {', '.join(TITAN_MODEL_TYPES)}",
                        hint="set trainer.engine: hf")
    dim, head_dim = c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # Weights are always loaded from the checkpoint: the initialisers only have to exist.
    normal = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def norm(size: int):
        return RMSNorm.Config(normalized_shape=size, eps=c.rms_norm_eps, param_init={"weight": nn.init.ones_})

    inner = get_attention_config("flex") if flex_attention else DocumentAttention.Config()
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=c.max_position_embeddings, theta=_rope_theta(c))
    layers = []
    for _ in range(c.num_hidden_layers):
        attention = make_gqa_config(dim=dim, n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                                    head_dim=head_dim, wqkv_param_init=normal, wo_param_init=normal,
                                    inner_attention=inner, rope=rope, fuse_qkv=False, qk_norm=norm(head_dim))
        block = dict(attention=attention, attention_norm=norm(dim), ffn_norm=norm(dim))
        if c.model_type == "qwen3_moe":
            experts, top_k = c.num_experts, c.num_experts_per_tok
            block["moe"] = make_moe_config(
                num_experts=experts,
                router=make_router_config(dim=dim, num_experts=experts, gate_param_init=normal, top_k=top_k,
                                          score_func="softmax", route_norm=bool(c.norm_topk_prob)),
                routed_experts=make_routed_experts_config(
                    dim=dim, hidden_dim=c.moe_intermediate_size, num_experts=experts, top_k=top_k,
                    param_init={w: normal["weight"] for w in ("w1_EFD", "w2_EDF", "w3_EFD")}, comm_backend="standard"),
                load_balance_coeff=None)  # RL trains the checkpoint's routers as they are: no bias updates
            if exact_experts:
                grouped = block["moe"].routed_experts.inner_experts
                block["moe"].routed_experts.inner_experts = ExactGroupedExperts.Config(
                    dim=grouped.dim, hidden_dim=grouped.hidden_dim, num_experts=grouped.num_experts,
                    param_init=grouped.param_init)
        else:
            block["feed_forward"] = make_ffn_config(dim=dim, hidden_dim=c.intermediate_size, w1_param_init=normal,
                                                    w2w3_param_init=normal)
        layers.append(Qwen3TransformerBlock.Config(**block))
    return Qwen3Model.Config(
        vocab_size=c.vocab_size, dim=dim, norm=norm(dim), enable_weight_tying=bool(c.tie_word_embeddings),
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=dim,
                                       param_init={"weight": normal["weight"]}),
        lm_head=Linear.Config(in_features=dim, out_features=c.vocab_size, param_init=normal), layers=layers)
