"""Memory model: bytes per GPU for a trainer rank and for an inference server rank.

Pure functions of `ModelFacts` and the parallel layout; every formula is stated next to its code and in
docs/planning.md. The numbers are estimates meant to reject layouts that cannot fit and to size the
KV cache, not to predict the allocator to the megabyte: the constants below err on the safe side.

Trainer conventions (torchtitan-style FSDP2 + EP + CP + TP):
- FSDP shards over dp_shard × cp (torchtitan folds the context-parallel ranks into the FSDP mesh) and
  TP splits each matrix, so a dense parameter lives on dp_shard·cp·tp ranks.
- Expert parallelism borrows its ranks from that same dp_shard·cp·tp group (torchtitan's expert mesh,
  ep innermost: the TP ranks first): each EP rank owns num_experts/ep whole experts (with ep > 1 TP
  does not split them), and those are FSDP-sharded again over the remaining
  dp_shard·cp·tp/ep ranks ("expert FSDP"). Per GPU, expert params therefore also end up divided by
  dp_shard·cp·tp; what EP changes is the size of a gathered layer (experts/ep instead of all experts).
- dp_replicate (HSDP) replicates the shards: each replica holds the whole model split dp_shard·cp·tp
  ways, so replication divides no parameter, gradient or optimizer memory; it multiplies the ranks (the
  world size) and adds a cross-replica all-reduce of the gradient shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from primebuild.builders.model_facts import ModelFacts
from primebuild.errors import UserError

GIB = 1024**3

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1,
}

# Optimizer states per parameter (kept in the master dtype).
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "muon": 1}

# Fixed per-process costs: the CUDA context with cuBLAS workspaces (measured on an H200 with torch 2.11:
# 0.58 GiB outside PyTorch's allocator; 1 GiB leaves room for cuDNN and other libraries) and NCCL's
# buffers for each communicator (FSDP, EP all-to-all, TP, CP each get one).
CUDA_CONTEXT_BYTES = 1 * GIB
NCCL_BUFFER_BYTES = 2 * GIB
# The caching allocator never packs perfectly; 5% of what is allocated is a typical loss at steady state.
FRAGMENTATION_FRACTION = 0.05
# Cross-entropy over the full vocabulary: bf16 logits, their fp32 upcast, fp32 log-softmax kept for the
# backward and its gradient. Measured on an H200 (torch 2.11, bf16 lm_head + F.cross_entropy on fp32,
# 8192 tokens × 32000 vocab): 11.4 bytes per (token, vocab entry) at the peak.
LOGITS_BYTES_PER_ELEMENT = 12
# Real saved-for-backward bytes over the tensor count of `layer_activation_bytes`, measured on an H200
# with transformers 5.17 eager Qwen3 (1.75×) and Qwen3-MoE (1.86×) layers in bf16, 8192 tokens: RMSNorm
# upcasts to fp32, RoPE and SiLU keep extra copies, MoE dispatch keeps gathered token copies. Fused or
# compiled layers (torchtitan with torch.compile) come close to 1.0: pass activation_factor=1.0 there.
HF_EAGER_ACTIVATION_FACTOR = 1.85
# The same ratio for fp32 eager layers on a CPU (no fused kernels, no bf16 upcasts), fitted on one rank
# of the tiny models by bench/trainer_memory.py: 1.40 dense Qwen3, 1.50 Qwen3-MoE. The plan uses it for
# `hardware.gpu: cpu`.
CPU_EAGER_ACTIVATION_FACTOR = 1.45
# FP8 checkpoints (DeepSeek-V3 / GLM-5 style) keep one fp32 scale per 128×128 weight block.
FP8_BLOCK = 128 * 128
FP8_SCALE_BYTES = 4
# A DSA indexer's float32 scores of every query against every key are [B, S, index_n_heads, T]: 512 GiB
# per layer for GLM-5 at 32k local queries × 128k keys. The trainer's indexer scores a chunk of queries at
# a time (primebuild/runtime/trainer/sparse_attention.py), as many as fit in this budget.
INDEX_SCORE_CHUNK_BYTES = 1 * GIB


def index_query_chunk(batch: int, index_heads: int, keys: int) -> int:
    """Queries per chunk of a DSA indexer: its [batch, chunk, index_heads, keys] fp32 scores fit the budget."""
    return max(1, INDEX_SCORE_CHUNK_BYTES // (batch * index_heads * keys * 4))


# vLLM: CUDA graphs for the decode batch sizes it captures (vLLM logs 0.5-2 GiB for large models).
CUDA_GRAPH_BYTES = 1 * GIB


def dtype_bytes(name: str, *, field: str = "dtype") -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise UserError(f"{field}: unknown dtype '{name}'",
                        hint=f"use one of: {', '.join(sorted(DTYPE_BYTES))}") from None


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")


def _ceil_div(a: float, b: int) -> int:
    return math.ceil(a / b)


# ---- weights ------------------------------------------------------------------------------------


def weight_bytes(facts: ModelFacts, precision: str) -> tuple[int, int]:
    """(non-expert bytes, routed-expert bytes) of the whole model stored in `precision`.

    fp8 stores the linear-layer weights in 1 byte plus one fp32 scale per 128×128 block; embeddings,
    lm_head, router and norms stay bf16 (as in the published FP8 checkpoints of DeepSeek-V3 and GLM-5).
    """
    counts = facts.param_counts()
    if precision != "fp8":
        b = dtype_bytes(precision, field="precision")
        experts = counts.routed_experts * b
        return math.ceil(counts.total * b - experts), math.ceil(experts)

    def fp8(n: int) -> int:
        return n + _ceil_div(n, FP8_BLOCK) * FP8_SCALE_BYTES

    dense_matmuls = counts.matmul_weights - counts.routed_experts
    kept_bf16 = counts.total - counts.matmul_weights
    return fp8(dense_matmuls) + 2 * kept_bf16, fp8(counts.routed_experts)


def broadcast_staging_bytes(facts: ModelFacts, wire_dtype: str, bucket_bytes: int) -> int:
    """What one receiving worker of a bucketed weight broadcast stages (primebuild/runtime/weight_sync/
    broadcast.py): the bucket being loaded and the next one arriving, each up to `bucket_bytes` of whole
    tensors, or one tensor bigger than that (the largest is the embedding, vocab × hidden); never more than
    the model itself (a model smaller than two buckets travels in fewer):
        min(model, 2 · max(bucket, vocab · hidden · wire_bytes))."""
    b = dtype_bytes(wire_dtype, field="model.dtype")
    model = math.ceil(facts.param_counts().total * b)
    return min(model, 2 * max(bucket_bytes, math.ceil(facts.vocab_size * facts.hidden_size * b)))


def delta_copy_bytes(facts: ModelFacts, wire_dtype: str) -> int:
    """Host memory a delta weight sync keeps at each end (weight_sync/delta.py): the last synced weights,
    unsharded, once on the sender and once per receiving worker."""
    return math.ceil(facts.param_counts().total * dtype_bytes(wire_dtype, field="model.dtype"))


# ---- trainer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer GPU at the step's peak (and what CPU offload moved to the host)."""

    params: int
    grads: int
    optimizer_state: int
    master_weights: int
    fsdp_buffers: int  # all-gathered layer params (current + prefetched) and one layer's full grads
    activations: int
    logits: int
    sparse_index: int  # one DSA layer's index scores (one query chunk) and key-selection masks; 0 if dense
    overhead: int  # CUDA context + NCCL buffers + fragmentation
    total: int
    free: int  # gpu_memory_bytes − total (negative: does not fit)
    fits: bool
    host_bytes: int  # optimizer state + master weights offloaded to host memory, per GPU
    tokens_per_gpu: int


def layer_activation_bytes(facts: ModelFacts, *, moe_layer: bool, act_bytes: float) -> float:
    """Bytes saved for backward per token in one layer, without recomputation (flash attention: no
    seq² score matrix is stored).

    Attention: the norm's input and output (2h) plus
      GQA: q (nq·hd), k and v (2·nkv·hd), attention output (nq·hd)
      MLA: q latent (q_lora), kv latent (kv_lora + rope), q and the per-head expanded k (2·nq·(nope+rope)),
           expanded v and the output (2·nq·v); a DSA indexer adds its q (heads·dim) and k (dim).
    MLP: norm input and output (2h) plus
      dense: gate, up and their product (3·I)
      MoE:   per routed copy its input, gate, up, product (k·(h + 3·mi)), shared experts (S·3·mi),
             and fp32 router logits (4·E bytes).
    """
    h, nq = facts.hidden_size, facts.num_attention_heads
    if facts.is_mla:
        attention = (
            facts.q_lora_rank + facts.kv_lora_rank + facts.qk_rope_head_dim
            + 2 * nq * (facts.qk_nope_head_dim + facts.qk_rope_head_dim) + 2 * nq * facts.v_head_dim
        )
    else:
        attention = 2 * nq * facts.head_dim + 2 * facts.num_kv_heads * facts.head_dim
    attention += facts.index_n_heads * facts.index_head_dim + facts.index_head_dim
    if moe_layer:
        mlp = (
            facts.experts_per_token * (h + 3 * facts.moe_intermediate_size)
            + facts.num_shared_experts * 3 * facts.moe_intermediate_size
        )
        router = 4 * facts.num_experts
    else:
        mlp, router = 3 * facts.intermediate_size, 0
    return act_bytes * (2 * h + attention + 2 * h + mlp) + router


def _largest_layer_params(facts: ModelFacts, *, tp: int, ep: int) -> int:
    """Params of the biggest unit FSDP gathers at once, still split by TP (dense) and EP (experts); without
    EP, TP splits each expert's hidden dimension too (torchtitan's MoE plan)."""
    counts = facts.param_counts()
    layer_common = facts.attention_params_per_layer() + 2 * facts.hidden_size
    dense_layer = layer_common + 3 * facts.hidden_size * facts.intermediate_size if facts.num_dense_layers else 0
    moe_layer = 0
    if facts.num_moe_layers:
        moe_layer = (
            layer_common + (facts.num_shared_experts * facts.expert_size + facts.num_experts * facts.hidden_size)
        ) / tp + facts.num_experts * facts.expert_size / (ep if ep > 1 else tp)
    return math.ceil(max(dense_layer / tp, moe_layer, counts.embedding / tp))


def trainer_memory_per_gpu(
    facts: ModelFacts,
    *,
    param_dtype: str = "bf16",
    master_dtype: str | None = "fp32",
    grad_dtype: str = "fp32",
    optimizer: str = "adamw",
    optimizer_cpu_offload: bool = False,
    dp_shard: int,
    dp_replicate: int = 1,
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
    activation_checkpointing: bool = True,
    micro_batch_tokens: int,
    seq_len: int,
    gpu_memory_bytes: int,
    activation_dtype: str = "bf16",
    logits_chunk_tokens: int | None = None,
    overhead_bytes: int | None = None,
    activation_factor: float = HF_EAGER_ACTIVATION_FACTOR,
    adapter_params: int | None = None,
) -> TrainerMemory:
    """Peak bytes on one trainer GPU.

    shards            = dp_shard · cp · tp                  (module docstring: dense and expert alike)
    params            = ceil(total_params / shards) · bytes(param_dtype)
    grads             = ceil(total_params / shards) · bytes(grad_dtype)
    master_weights    = ceil(total_params / shards) · bytes(master_dtype), 0 when master == param dtype
    optimizer_state   = states(optimizer) · ceil(total_params / shards) · bytes(master_dtype or fp32)
                        (with optimizer_cpu_offload all four go to host_bytes: FSDP2's CPUOffloadPolicy keeps
                        the shards on the host; the device holds the gathered layers, activations, logits)
    fsdp_buffers      = largest gathered layer L (params/tp, experts/ep) · (2 · bytes(param) + bytes(grad))
                        when dp_shard · cp · dp_replicate > 1 (fully_shard wraps every layer as soon as there
                        are two FSDP ranks; TP, and EP on the TP ranks, shard without it): the current and
                        prefetched layer, and one layer's unsharded grads
    tokens_per_gpu    = ceil(micro_batch_tokens / cp)
    activations       = tokens_per_gpu / tp · (num_layers · h · act_bytes + f · max_layer_activation)
                        with full activation checkpointing (each layer's input kept, one layer live);
                        tokens_per_gpu / tp · f · Σ_layers layer_activation without it (TP with sequence
                        parallelism splits every activation); f = activation_factor (measured eager 1.85)
                        ep > 1 adds, per MoE layer, the received copy of each routed token (k · h · act_bytes)
                        that the local experts keep for backward beside the sender's;
                        cp > 1 (not DSA: sparse_index counts it there) adds the attention's visibility mask,
                        tokens_per_gpu · micro_batch_tokens · (1 + act_bytes) (bool + SDPA's additive copy;
                        runtime/trainer/context_parallel.py), one layer's with checkpointing, every layer's
                        without (attention keeps its mask for backward)
    logits            = min(tokens_per_gpu, logits_chunk_tokens) · vocab · 12  (measured peak); with tp > 1
                        + vocab · h · (bytes(param) + bytes(grad)): the torchtitan engine gathers the
                        vocab-split head for its log-probs (runtime/trainer/titan_policy.py), so neither
                        the chunk's logits nor the head are divided by tp
    sparse_index      = DSA models: B·C·H·T·4 (one query chunk's fp32 scores, index_query_chunk) + B·S·T·m,
                        B = ceil(micro_batch_tokens / seq_len), S = seq_len / cp local queries, T = seq_len
                        keys, H = index_n_heads; m bool/act bytes per (query, key) of the selection masks:
                        cp > 1: chosen + visible bools + SDPA's additive copy (2 + act_bytes);
                        cp = 1: causal, index and combined bools + SDPA's additive copy (3 + act_bytes)
    overhead          = CUDA context (1 GiB) + NCCL (2 GiB) + 5% of everything else

    With LoRA (`adapter_params` = A: primebuild/builders/lora.py) the base is frozen: params and master weights count
    total + A, but grads and optimizer state only A, and a gathered layer brings no full-size grads.
    """
    _check_trainer_layout(facts, optimizer=optimizer, dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, ep=ep,
                          tp=tp, micro_batch_tokens=micro_batch_tokens, seq_len=seq_len)
    shards = dp_shard * cp * tp
    p_bytes = dtype_bytes(param_dtype, field="param_dtype")
    g_bytes = dtype_bytes(grad_dtype, field="grad_dtype")
    has_master = master_dtype is not None and dtype_bytes(master_dtype, field="master_dtype") != p_bytes
    m_bytes = dtype_bytes(master_dtype, field="master_dtype") if master_dtype else 0
    state_bytes = m_bytes or 4
    a_bytes = dtype_bytes(activation_dtype, field="activation_dtype")

    params_per_gpu = _ceil_div(facts.total_params() + (adapter_params or 0), shards)
    trained_per_gpu = params_per_gpu if adapter_params is None else _ceil_div(adapter_params, shards)
    params = math.ceil(params_per_gpu * p_bytes)
    grads = math.ceil(trained_per_gpu * g_bytes)
    master = math.ceil(params_per_gpu * m_bytes) if has_master else 0
    optimizer_state = math.ceil(OPTIMIZER_STATES[optimizer] * trained_per_gpu * state_bytes)
    host_bytes = 0
    if optimizer_cpu_offload:  # FSDP2's CPUOffloadPolicy: every shard lives on the host, the optimizer steps there
        host_bytes = params + grads + master + optimizer_state
        params = grads = master = optimizer_state = 0

    fsdp_buffers = 0
    if dp_shard * cp * dp_replicate > 1:  # TP (and EP on its ranks) alone shard without FSDP: nothing gathered
        layer_grad_bytes = 0 if adapter_params is not None else g_bytes  # frozen base: no full-size grads
        fsdp_buffers = math.ceil(_largest_layer_params(facts, tp=tp, ep=ep) * (2 * p_bytes + layer_grad_bytes))

    tokens = _ceil_div(micro_batch_tokens, cp)
    activations = _activation_bytes(facts, tokens, tp=tp, ep=ep, act_bytes=a_bytes,
                                    activation_checkpointing=activation_checkpointing,
                                    activation_factor=activation_factor)

    if cp > 1 and not facts.index_topk:
        kept_layers = 1 if activation_checkpointing else facts.num_layers
        activations += tokens * micro_batch_tokens * (1 + a_bytes) * kept_layers

    logit_tokens = min(tokens, logits_chunk_tokens) if logits_chunk_tokens else tokens
    logits = logit_tokens * facts.vocab_size * LOGITS_BYTES_PER_ELEMENT
    if tp > 1:
        logits += math.ceil(facts.vocab_size * facts.hidden_size * (p_bytes + g_bytes))

    sparse_index = _sparse_index_bytes(facts, micro_batch_tokens=micro_batch_tokens, seq_len=seq_len, cp=cp,
                                       act_bytes=a_bytes)

    allocated = params + grads + master + optimizer_state + fsdp_buffers + activations + logits + sparse_index
    fixed = CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES if overhead_bytes is None else overhead_bytes
    overhead = fixed + math.ceil(FRAGMENTATION_FRACTION * allocated)
    total = allocated + overhead
    return TrainerMemory(
        params=params, grads=grads, optimizer_state=optimizer_state, master_weights=master,
        fsdp_buffers=fsdp_buffers, activations=activations, logits=logits, sparse_index=sparse_index,
        overhead=overhead,
        total=total, free=gpu_memory_bytes - total, fits=total <= gpu_memory_bytes,
        host_bytes=host_bytes, tokens_per_gpu=tokens,
    )


def _check_trainer_layout(facts: ModelFacts, *, optimizer: str, dp_shard: int, dp_replicate: int, cp: int, ep: int,
                          tp: int, micro_batch_tokens: int, seq_len: int) -> None:
    """The degrees and sizes the trainer model can count: a located message for each that it cannot."""
    _positive(dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, ep=ep, tp=tp,
              micro_batch_tokens=micro_batch_tokens, seq_len=seq_len)
    if optimizer not in OPTIMIZER_STATES:
        raise UserError(f"trainer.optimizer: unknown optimizer '{optimizer}'",
                        hint=f"use one of: {', '.join(sorted(OPTIMIZER_STATES))}")
    shards = dp_shard * cp * tp
    if ep > 1:
        _check_experts(facts, ep)
        if shards % ep:
            raise UserError(f"ep={ep} must divide dp_shard·cp·tp = {shards}: expert parallelism borrows "
                            "its ranks from the FSDP, CP and TP ranks")
    if facts.num_attention_heads % tp:
        raise UserError(f"tp={tp} must divide num_attention_heads ({facts.num_attention_heads})")
    if micro_batch_tokens < seq_len:
        raise UserError(f"micro_batch_tokens ({micro_batch_tokens}) is smaller than seq_len ({seq_len})",
                        hint="a micro-batch must hold one whole sequence; context parallelism (cp) "
                        "splits it across GPUs")


def _check_experts(facts: ModelFacts, ep: int) -> None:
    """Expert parallelism (trainer or inference) needs experts, a number of them that `ep` divides."""
    if not facts.is_moe:
        raise UserError(f"ep={ep} needs a mixture-of-experts model; {facts.architecture} is dense",
                        hint="set ep: 1")
    if facts.num_experts % ep:
        raise UserError(f"ep={ep} must divide the number of experts ({facts.num_experts})")


def _activation_bytes(facts: ModelFacts, tokens: int, *, tp: int, ep: int, act_bytes: int,
                      activation_checkpointing: bool, activation_factor: float) -> int:
    """Activations kept for backward by `tokens` tokens on one GPU (see trainer_memory_per_gpu)."""
    dense_act = layer_activation_bytes(facts, moe_layer=False, act_bytes=act_bytes)
    moe_act = layer_activation_bytes(facts, moe_layer=True, act_bytes=act_bytes) if facts.num_moe_layers else 0
    # measured (bench/trainer_memory.py): EP=2 keeps 1.0 extra routed-token copy per MoE layer on average
    ep_dispatch = facts.experts_per_token * facts.hidden_size * act_bytes if ep > 1 and facts.num_moe_layers else 0
    if activation_checkpointing:
        per_token = facts.num_layers * facts.hidden_size * act_bytes + max(
            activation_factor * dense_act if facts.num_dense_layers else 0, activation_factor * moe_act + ep_dispatch)
    else:
        per_token = (activation_factor * (facts.num_dense_layers * dense_act + facts.num_moe_layers * moe_act)
                     + facts.num_moe_layers * ep_dispatch)
    return math.ceil(tokens * per_token / tp)


def _sparse_index_bytes(facts: ModelFacts, *, micro_batch_tokens: int, seq_len: int, cp: int, act_bytes: int) -> int:
    """DSA models: one query chunk's index scores and the selection masks (see trainer_memory_per_gpu)."""
    if not facts.index_topk:
        return 0
    batch, queries = _ceil_div(micro_batch_tokens, seq_len), _ceil_div(seq_len, cp)
    chunk = min(queries, index_query_chunk(batch, facts.index_n_heads, seq_len))
    masks_per_pair = (2 if cp > 1 else 3) + act_bytes
    return math.ceil(batch * chunk * facts.index_n_heads * seq_len * 4
                     + batch * queries * seq_len * masks_per_pair)


# ---- inference ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InferenceMemory:
    """Bytes on one inference GPU (one rank of a vLLM-style engine) and the KV cache that fits."""

    weights: int
    activations: int  # peak of a forward over max_num_batched_tokens + sampler logits
    overhead: int  # CUDA context + NCCL + CUDA graphs
    budget: int  # gpu_memory_bytes · gpu_memory_utilization
    kv_cache_bytes: int
    kv_bytes_per_token: int  # on this GPU
    kv_tokens_capacity: int  # tokens this GPU's cache holds (a TP group holds the same tokens)
    max_concurrent_seqs: int  # full-length sequences one engine (data-parallel rank) runs at once
    max_concurrent_seqs_total: int  # × dp
    fits: bool


def kv_dtype_bytes(kv_cache_dtype: str, auto_bytes: int = 2) -> float:
    """vLLM semantics: "auto" caches in the engine's activation dtype, `auto_bytes` (bf16's 2, even for FP8
    weights; 4 where the engine computes in fp32: precision fp32, the embedded engine's FP8 on a CPU)."""
    if kv_cache_dtype == "auto":
        return auto_bytes
    if kv_cache_dtype in ("bf16", "bfloat16", "fp16", "float16"):
        return 2
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 1
    raise UserError(f"inference.kv_cache_dtype: unknown value '{kv_cache_dtype}'",
                    hint="use 'auto', 'bf16' or 'fp8'")


def inference_memory_per_gpu(
    facts: ModelFacts,
    *,
    precision: str = "bf16",
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    ep: int = 1,
    dp: int = 1,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int,
    seq_len: int,
    max_num_batched_tokens: int = 8192,
    overhead_bytes: int | None = None,
) -> InferenceMemory:
    """Bytes on one GPU of an inference engine with `tp` tensor-parallel ranks, replicated `dp` times
    (data-parallel attention), experts spread over `ep` ranks.

    weights       = non_expert_bytes / tp + expert_bytes / (ep if ep > 1 else tp)
                    (vLLM --enable-expert-parallel puts whole experts on ep = tp·dp ranks; without it
                    every expert is TP-sharded)
    activations   = max_num_batched_tokens · 2 · (4h + 3·max(I/tp, k·mi)) + max_num_seqs · vocab · 4
    overhead      = CUDA context (1 GiB) + NCCL (2 GiB) + CUDA graphs (1 GiB)
    budget        = gpu_memory_bytes · gpu_memory_utilization
    kv_cache      = budget − weights − activations − overhead
    kv_capacity   = kv_cache // kv_bytes_per_token (MLA latent replicated on every TP rank; GQA heads split)
    concurrency   = min(max_num_seqs, kv_capacity // seq_len) per engine
    fits          = weights + activations + overhead ≤ budget and one seq_len sequence fits
    """
    _positive(tp=tp, ep=ep, dp=dp, max_num_seqs=max_num_seqs, seq_len=seq_len,
              max_num_batched_tokens=max_num_batched_tokens)
    if precision not in ("fp32", "bf16", "fp8"):
        raise UserError(f"inference.precision: unknown value '{precision}'", hint="use 'fp32', 'bf16' or 'fp8'")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if facts.num_attention_heads % tp:
        raise UserError(f"tp={tp} must divide num_attention_heads ({facts.num_attention_heads})")
    if ep > 1:
        _check_experts(facts, ep)
        if (tp * dp) % ep:
            raise UserError(f"ep={ep} must divide tp·dp = {tp * dp}: an engine spreads its experts over "
                            "its own tensor- and data-parallel ranks")

    non_expert, experts = weight_bytes(facts, precision)
    weights = _ceil_div(non_expert, tp) + _ceil_div(experts, ep if ep > 1 else tp)

    widest_mlp = max(_ceil_div(facts.intermediate_size, tp),
                     facts.experts_per_token * facts.moe_intermediate_size)
    activations = (max_num_batched_tokens * 2 * (4 * facts.hidden_size + 3 * widest_mlp)
                   + max_num_seqs * facts.vocab_size * 4)
    # overhead_bytes replaces the whole fixed overhead (e.g. on CPU: no CUDA context, graphs or NCCL).
    overhead = CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + CUDA_GRAPH_BYTES if overhead_bytes is None else overhead_bytes

    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    kv_cache = max(0, budget - weights - activations - overhead)
    kv_per_token = facts.kv_bytes_per_token(kv_dtype_bytes(kv_cache_dtype, 4 if precision == "fp32" else 2), tp=tp)
    capacity = kv_cache // kv_per_token
    concurrent = min(max_num_seqs, capacity // seq_len)
    return InferenceMemory(
        weights=weights, activations=activations, overhead=overhead, budget=budget,
        kv_cache_bytes=kv_cache, kv_bytes_per_token=kv_per_token, kv_tokens_capacity=capacity,
        max_concurrent_seqs=concurrent, max_concurrent_seqs_total=concurrent * dp,
        fits=weights + activations + overhead <= budget and capacity >= seq_len,
    )
