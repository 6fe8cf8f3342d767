"""Throughput model: seconds per RL step for rollouts (inference), training and weight sync.

Roofline estimates, stated so that a person can check them by hand (docs/planning.md):
- prefill is compute bound: 2·N·tokens + attention flops at an assumed MFU;
- decode is memory-bandwidth bound: every step reads the weights the batch touches plus the KV cache
  of every sequence, at an assumed fraction of HBM bandwidth (compute is checked too);
- training costs 6·N·tokens + 3× the forward attention flops at an assumed MFU.
N is `ModelFacts.matmul_params_per_token()` (active params without the embedding lookup).
Inference and training overlap (asynchronous RL, one step off-policy), so a step takes the longer of
the two, and the other side idles for the difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from primebuild.builders.hardware import GpuSpec, gpu_spec
from primebuild.builders.memory import kv_dtype_bytes, weight_bytes
from primebuild.builders.model_facts import ModelFacts
from primebuild.builders.rollout_time import Costs
from primebuild.contracts.estimates import StepTimes, WeightSyncEstimate
from primebuild.errors import UserError

# Assumed efficiencies (fractions of the dense peak). MFU 0.35 is what well-tuned FSDP/EP trainers
# report for large MoE models in bf16; prefill with long prompts reaches somewhat more; decode kernels
# reach 50-70% of HBM bandwidth at useful batch sizes.
TRAINER_MFU = 0.35
PREFILL_MFU = 0.40
DECODE_BANDWIDTH_EFFICIENCY = 0.6


def _gpu(gpu: GpuSpec | str) -> GpuSpec:
    return gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)


# ---- weight sync --------------------------------------------------------------------------------


def weight_sync_estimate(
    facts: ModelFacts,
    *,
    dtype: str,
    bandwidth_bytes_per_s: float,
    mode: str = "filesystem",
    trainer_gpus: int,
    inference_gpus: int,
    inference_replicas: int = 1,
) -> WeightSyncEstimate:
    """Time to move one step's weights from the trainer to every inference replica.

    filesystem: the trainer ranks write one copy (their shards, in parallel) to shared storage, then
      every inference replica reads a whole copy; `bandwidth_bytes_per_s` is the storage's aggregate
      bandwidth, shared by concurrent readers:  seconds = bytes·(1 + replicas) / bandwidth.
    broadcast: trainer ranks gather each bucket onto rank 0, which NCCL-broadcasts it to all inference
      GPUs over the inter-node network (pipelined, so each link carries the bytes once):
      seconds = bytes·(trainer_gpus − 1)/trainer_gpus / bandwidth + bytes / bandwidth.
    """
    if mode not in ("filesystem", "broadcast"):
        raise UserError(f"weight_sync.mode: unknown value '{mode}'", hint="use 'filesystem' or 'broadcast'")
    if bandwidth_bytes_per_s <= 0:
        raise UserError("weight sync bandwidth must be positive")
    if min(trainer_gpus, inference_gpus, inference_replicas) < 1 or inference_replicas > inference_gpus:
        raise UserError("weight sync needs ≥ 1 trainer GPU and 1 ≤ inference_replicas ≤ inference_gpus")
    size = sum(weight_bytes(facts, dtype))
    if mode == "filesystem":
        write = size / bandwidth_bytes_per_s
        read = inference_replicas * size / bandwidth_bytes_per_s
    else:
        write = size * (trainer_gpus - 1) / trainer_gpus / bandwidth_bytes_per_s
        read = size / bandwidth_bytes_per_s
    return WeightSyncEstimate(mode=mode, bytes=size, seconds=write + read, write_seconds=write, read_seconds=read)


# ---- flops and bytes per token ------------------------------------------------------------------


def _attended_pairs(seq_len: int, topk: int) -> int:
    """(query, key) pairs of causal attention over seq_len tokens, each query seeing ≤ topk keys."""
    full = seq_len * (seq_len + 1) // 2
    if not topk or seq_len <= topk:
        return full
    return topk * (topk + 1) // 2 + (seq_len - topk) * topk


def attention_forward_flops(facts: ModelFacts, seq_len: int) -> int:
    """Forward flops of attention scores and weighted values for one causal sequence:
    layers · [2 · pairs · heads · (d_qk + d_v)  +  2 · all_pairs · index_heads · index_dim]
    (pairs capped at index_topk keys per query with DSA; the indexer itself scores all pairs)."""
    d_v = facts.v_head_dim or facts.head_dim
    pairs = _attended_pairs(seq_len, facts.index_topk)
    all_pairs = seq_len * (seq_len + 1) // 2
    per_layer = (2 * pairs * facts.num_attention_heads * (facts.head_dim + d_v)
                 + 2 * all_pairs * facts.index_n_heads * facts.index_head_dim)
    return facts.num_layers * per_layer


def distinct_experts(facts: ModelFacts, batch: int) -> float:
    """Expected experts per MoE layer that a batch of tokens routes to (uniform routing):
    E · (1 − (1 − k/E)^batch). One token reads k experts; large batches read all E."""
    if not facts.is_moe:
        return 0.0
    e, k = facts.num_experts, facts.experts_per_token
    return e * (1 - (1 - k / e) ** batch)


def kv_read_bytes(facts: ModelFacts, context: int, kv_bytes: float) -> float:
    """KV-cache bytes one decode step reads for one sequence at `context` tokens: attention reads
    min(context, index_topk) cached tokens per layer, a DSA indexer reads all its keys."""
    attention, indexer = facts.kv_elements_per_token_per_layer()
    attended = min(context, facts.index_topk) if facts.index_topk else context
    return facts.num_layers * (attended * attention + context * indexer) * kv_bytes


# ---- step time ----------------------------------------------------------------------------------


def teacher_scoring_seconds(teacher: ModelFacts, *, rollouts_per_step: int, seq_len: int, gpus: int,
                            gpu: GpuSpec | str, precision: str = "bf16", prefill_mfu: float = PREFILL_MFU) -> float:
    """On-policy distillation: the teacher's server prefills every rollout of a step, prompt and completion,
    to score its tokens (orchestrator/teacher.py) on its own `gpus`: compute bound, like a prefill."""
    spec = _gpu(gpu)
    flops = rollouts_per_step * (2 * teacher.matmul_params_per_token() * seq_len
                                 + attention_forward_flops(teacher, seq_len))
    return flops / (gpus * spec.flops(precision) * prefill_mfu)


def step_time_estimate(
    facts: ModelFacts,
    *,
    rollouts_per_step: int,
    group_size: int,
    prompt_tokens: int,
    completion_tokens: int,
    inference_gpus: int,
    inference_replicas: int,
    trainer_gpus: int,
    gpu: GpuSpec | str,
    precision: str = "bf16",
    trainer_precision: str = "bf16",
    kv_cache_dtype: str = "auto",
    prefill_gpus: int = 0,
    max_concurrent_seqs_per_replica: int | None = None,
    trainer_mfu: float = TRAINER_MFU,
    prefill_mfu: float = PREFILL_MFU,
    decode_bandwidth_efficiency: float = DECODE_BANDWIDTH_EFFICIENCY,
    teacher_seconds: float = 0.0,
) -> StepTimes:
    """Seconds for one RL step (see docs/planning.md for the formulas and their limits).

    rollouts_per_step counts completions (sequences); group_size of them share a prompt, which is
    prefilled once (prefix caching). prefill_gpus > 0 splits prefill and decode (P/D): prefill runs on
    those GPUs, decode on the other inference_gpus − prefill_gpus in `inference_replicas` engines.
    max_concurrent_seqs_per_replica (from inference_memory_per_gpu) caps the decode batch. teacher_seconds
    (distillation, teacher_scoring_seconds) comes after the rollouts, before the batch reaches the trainer.
    """
    spec = _gpu(gpu)
    for name, value in dict(rollouts_per_step=rollouts_per_step, group_size=group_size,
                            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            inference_gpus=inference_gpus, inference_replicas=inference_replicas,
                            trainer_gpus=trainer_gpus).items():
        if value < 1:
            raise UserError(f"{name} must be ≥ 1, got {value}")
    decode_gpus = inference_gpus - prefill_gpus
    if prefill_gpus < 0 or decode_gpus < inference_replicas:
        raise UserError(f"prefill_gpus={prefill_gpus} leaves {decode_gpus} decode GPUs for "
                        f"{inference_replicas} replicas")

    # Prefill: compute bound, each prompt once per group.
    n_mm = facts.matmul_params_per_token()
    prompts = math.ceil(rollouts_per_step / group_size)
    prefill_flops = prompts * (2 * n_mm * prompt_tokens + attention_forward_flops(facts, prompt_tokens))
    prefill_pool = prefill_gpus or inference_gpus
    prefill_seconds = prefill_flops / (prefill_pool * spec.flops(precision) * prefill_mfu)

    # Decode: bandwidth bound; every step reads the touched weights plus each sequence's KV cache.
    gpus_per_replica = decode_gpus / inference_replicas
    seqs = math.ceil(rollouts_per_step / inference_replicas)
    batch = seqs if max_concurrent_seqs_per_replica is None else min(seqs, max_concurrent_seqs_per_replica)
    if batch < 1:
        raise UserError("no full-length sequence fits in an inference replica's KV cache",
                        hint="use more GPUs per replica, fp8 weights or KV cache, or a shorter seq_len")
    waves = math.ceil(seqs / batch)
    decode_step = decode_step_seconds(
        facts, batch=batch, context=prompt_tokens + completion_tokens / 2, gpus_per_replica=gpus_per_replica,
        gpu=spec, precision=precision, kv_cache_dtype=kv_cache_dtype, prefill_mfu=prefill_mfu,
        decode_bandwidth_efficiency=decode_bandwidth_efficiency)
    decode_seconds = waves * completion_tokens * decode_step

    rollout_seconds = (max(prefill_seconds, decode_seconds) if prefill_gpus
                       else prefill_seconds + decode_seconds) + teacher_seconds

    seq_len = prompt_tokens + completion_tokens
    tokens = rollouts_per_step * seq_len
    train_seconds = train_step_seconds(facts, sequences=rollouts_per_step, seq_len=seq_len, trainer_gpus=trainer_gpus,
                                       gpu=spec, trainer_precision=trainer_precision, trainer_mfu=trainer_mfu)

    step = max(rollout_seconds, train_seconds)
    if math.isclose(rollout_seconds, train_seconds, rel_tol=1e-9):
        idle_side, idle = "none", 0.0
    elif rollout_seconds > train_seconds:
        idle_side, idle = "trainer", 1 - train_seconds / step
    else:
        idle_side, idle = "inference", 1 - rollout_seconds / step
    return StepTimes(
        prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, teacher_seconds=teacher_seconds,
        rollout_seconds=rollout_seconds,
        train_seconds=train_seconds, step_seconds=step, idle_side=idle_side, idle_fraction=idle,
        decode_batch_per_replica=batch, decode_waves=waves, decode_step_seconds=decode_step,
        tokens_per_step=tokens,
    )


def prefill_seconds_per_token(facts: ModelFacts, *, context: int, gpus: int, gpu: GpuSpec | str,
                              precision: str = "bf16", prefill_mfu: float = PREFILL_MFU) -> float:
    """Seconds to prefill one more token on `gpus` GPUs at `context` tokens (2·N plus its attention row)."""
    spec = _gpu(gpu)
    d_v = facts.v_head_dim or facts.head_dim
    attended = min(context, facts.index_topk) if facts.index_topk else context
    flops = 2 * facts.matmul_params_per_token() + 2 * facts.num_layers * facts.num_attention_heads * (
        facts.head_dim + d_v) * attended
    return flops / (gpus * spec.flops(precision) * prefill_mfu)


def decode_step_seconds(facts: ModelFacts, *, batch: int, context: float, gpus_per_replica: float,
                        gpu: GpuSpec | str, precision: str = "bf16", kv_cache_dtype: str = "auto",
                        prefill_mfu: float = PREFILL_MFU,
                        decode_bandwidth_efficiency: float = DECODE_BANDWIDTH_EFFICIENCY,
                        weights: tuple[int, int] | None = None, n_mm: int | None = None) -> float:
    """One decode step of `batch` sequences at `context` tokens on one replica: the longer of reading the
    touched weights plus every sequence's KV cache, and the step's flops. `weights` (weight_bytes) and
    `n_mm` (matmul params per token) may be passed in by a caller that asks many times."""
    spec = _gpu(gpu)
    n_mm = facts.matmul_params_per_token() if n_mm is None else n_mm
    non_expert_bytes, expert_bytes = weight_bytes(facts, precision) if weights is None else weights
    embedding_bytes = facts.vocab_size * facts.hidden_size * 2  # only looked up, not read whole
    per_expert = expert_bytes / (facts.num_moe_layers * facts.num_experts) if facts.is_moe else 0
    weights_read = (non_expert_bytes - embedding_bytes
                    + facts.num_moe_layers * distinct_experts(facts, batch) * per_expert)
    kv_read = batch * kv_read_bytes(facts, math.ceil(context), kv_dtype_bytes(kv_cache_dtype))
    memory_time = (weights_read + kv_read) / (gpus_per_replica * spec.hbm_bytes_per_s
                                              * decode_bandwidth_efficiency)
    decode_flops = batch * (2 * n_mm + 2 * facts.num_layers * facts.num_attention_heads
                            * (facts.head_dim + (facts.v_head_dim or facts.head_dim))
                            * (min(context, facts.index_topk) if facts.index_topk else context))
    compute_time = decode_flops / (gpus_per_replica * spec.flops(precision) * prefill_mfu)
    return max(memory_time, compute_time)


def train_step_seconds(facts: ModelFacts, *, sequences: int, seq_len: int, trainer_gpus: int, gpu: GpuSpec | str,
                       trainer_precision: str = "bf16", trainer_mfu: float = TRAINER_MFU) -> float:
    """Training on `sequences` sequences of `seq_len` tokens: 6·N per token plus backward-inclusive
    attention (3× the forward)."""
    spec = _gpu(gpu)
    train_flops = (6 * facts.matmul_params_per_token() * sequences * seq_len
                   + 3 * sequences * attention_forward_flops(facts, seq_len))
    return train_flops / (trainer_gpus * spec.flops(trainer_precision) * trainer_mfu)


# GPU: what a model turn costs beyond its tokens (scheduling, the HTTP round trip, detokenising): tens
# of milliseconds in vLLM's OpenAI server; only agentic profiles with many turns notice it.
GPU_TURN_OVERHEAD_S = 0.02


def gpu_costs(facts: ModelFacts, gpu: GpuSpec | str, *, gpus_per_replica: float, precision: str,
              kv_cache_dtype: str, prefill_gpus: int, trainer_gpus: int, trainer_precision: str,
              weight_sync_s: float, seq_len: int, teacher_s: float = 0.0) -> Costs:
    """The rollout-profile model's costs on GPUs: the roofline formulas above."""
    spec = _gpu(gpu)
    weights, n_mm = weight_bytes(facts, precision), facts.matmul_params_per_token()  # once: param counts are slow
    return Costs(
        decode_step_s=lambda batch, context: decode_step_seconds(
            facts, batch=batch, context=context, gpus_per_replica=gpus_per_replica, gpu=spec, precision=precision,
            kv_cache_dtype=kv_cache_dtype, weights=weights, n_mm=n_mm),
        prefill_s_per_token=prefill_seconds_per_token(facts, context=seq_len // 2, gpus=prefill_gpus, gpu=spec,
                                                      precision=precision),
        turn_overhead_s=GPU_TURN_OVERHEAD_S,
        request_s=0.0,  # vLLM's API server handles requests concurrently with the engine's steps
        train_s=lambda sequences, tokens: train_step_seconds(
            facts, sequences=sequences, seq_len=tokens, trainer_gpus=trainer_gpus, gpu=spec,
            trainer_precision=trainer_precision),
        weight_sync_s=weight_sync_s, teacher_s=teacher_s)


# CPU (the embedded engine and the fsdp2 trainer on a few cores, fp32, tiny models): calibrated on the
# 2-core CI machine with the reverse-text model (0.5M params, bench/async_rl.py --calibrate; the figures
# and their spread in bench/RESULTS.md). Costs are per thread and scale with 2·N (inference) or 6·N
# (training) per token; fixed costs are per call.
CPU_FLOPS_PER_THREAD = 2.0e10  # effective FLOP/s of one thread on these small matmuls
CPU_DECODE_STEP_OVERHEAD_S = 6e-4  # one engine step (scheduling, sampling, small-op calls)
CPU_TURN_OVERHEAD_S = 0.007  # one model turn: the HTTP round trip on both sides, validation, prefill set-up
# Of that, what serializes on the server with many requests in flight: long-tail bench at m = 32, where
# the server always had a request (about 42 turns per 0.14 s step, bench/RESULTS.md).
CPU_REQUEST_S = 0.0033
CPU_TRAIN_FLOPS_PER_THREAD = 2.0e10
# inference.batch_invariant: a decode step attends one sequence at a time (one SDPA call and its slicing per
# sequence and layer). bench/engine.py on the tiny model (2 layers): +1.5 ms a step at 16 sequences, +6.2 ms at 64,
# i.e. ~48 us per sequence and layer (bench/RESULTS.md "Batch invariance").
CPU_BATCH_INVARIANT_SEQ_LAYER_S = 4.8e-5
CPU_TRAIN_STEP_OVERHEAD_S = 0.05  # optimizer step, loading the batch, per-micro-batch calls
# Synchronous RL only: what a weight update costs beyond the sync itself (cpu_weight_sync_estimate): the
# orchestrator noticing, the engine pausing and resuming. 0.15 s in all was calibrated with the
# reverse-text model, whose sync is ~0.012 s of that.
CPU_WEIGHT_UPDATE_HANDOFF_S = 0.137

# CPU weight sync, per mode (cpu_weight_sync_estimate): calibrated on the 2-core CI machine by
# bench/weight_sync_time.py with the reverse-text model (2 MB in fp32) and a 120M Qwen3-shaped one (257 MB in
# bf16), 1 and 2 receivers, the machine shared with other jobs (medians and spread in bench/RESULTS.md).
# Receivers share the node's cores, so their loads add up rather than overlap.
CPU_FS_SYNC_S = 0.004  # filesystem, per publish: config, STABLE marker, rename
# The publish writes safetensors, sha256-lists and fsyncs them: a few MB go at page-cache speed, beyond
# that this machine's disk sets the pace (257 MB took 1.5-3 s to write, 0.1 s to fsync: dirty-page throttling).
CPU_FS_CACHED_BYTES = 32e6
CPU_FS_CACHED_BYTES_PER_S = 1.0e9
CPU_FS_DISK_BYTES_PER_S = 0.11e9
CPU_FS_LOAD_S = 0.003  # per receiver: its 10 ms poll notices the folder, opens and parses it
CPU_FS_LOAD_BYTES_PER_S = 0.65e9  # per receiver: sha256 verified, read (page cache), copied into its weights
CPU_BROADCAST_SYNC_S = 0.007  # broadcast, per sync: announce and go through the store
CPU_BROADCAST_RECEIVER_S = 0.003  # per receiver: its poll sees the announcement, its ready, a bucket's calls
# 120M model, 30 syncs in 4 runs each: median 0.35 s to 1 receiver, 0.59 s to 2 (the difference: one receiver)
CPU_BROADCAST_PACK_BYTES_PER_S = 1.6e9  # the sender packs every bucket once
CPU_BROADCAST_BYTES_PER_S = 1.2e9  # per receiver: gloo over loopback and its copy into its weights


def cpu_weight_sync_estimate(size_bytes: int, *, mode: str, receivers: int) -> WeightSyncEstimate:
    """Seconds per weight sync of `size_bytes` to `receivers` servers on a CPU node: a pure function of
    the two (the constants above).

    filesystem: write = CPU_FS_SYNC_S + min(bytes, CACHED)/CPU_FS_CACHED_BYTES_PER_S
                        + max(0, bytes − CACHED)/CPU_FS_DISK_BYTES_PER_S,
                read = receivers · (CPU_FS_LOAD_S + bytes / CPU_FS_LOAD_BYTES_PER_S)
    broadcast:  write = CPU_BROADCAST_SYNC_S,
                read = bytes / CPU_BROADCAST_PACK_BYTES_PER_S
                       + receivers · (CPU_BROADCAST_RECEIVER_S + bytes / CPU_BROADCAST_BYTES_PER_S)
    """
    if mode not in ("filesystem", "broadcast"):
        raise UserError(f"weight_sync.mode: unknown value '{mode}'", hint="use 'filesystem' or 'broadcast'")
    if receivers < 1 or size_bytes < 0:
        raise UserError(f"weight sync needs ≥ 1 receiver and a size ≥ 0 (got {receivers}, {size_bytes})")
    if mode == "filesystem":
        cached = min(size_bytes, CPU_FS_CACHED_BYTES)
        write = (CPU_FS_SYNC_S + cached / CPU_FS_CACHED_BYTES_PER_S
                 + (size_bytes - cached) / CPU_FS_DISK_BYTES_PER_S)
        read = receivers * (CPU_FS_LOAD_S + size_bytes / CPU_FS_LOAD_BYTES_PER_S)
    else:
        write = CPU_BROADCAST_SYNC_S
        read = (size_bytes / CPU_BROADCAST_PACK_BYTES_PER_S
                + receivers * (CPU_BROADCAST_RECEIVER_S + size_bytes / CPU_BROADCAST_BYTES_PER_S))
    return WeightSyncEstimate(mode=mode, bytes=size_bytes, seconds=write + read, write_seconds=write,
                              read_seconds=read)


def cpu_costs(facts: ModelFacts, cpus_per_node: int, weight_sync_s: float, *,
              batch_invariant: bool = False, inference_threads: int | None = None) -> Costs:
    """The rollout-profile model's costs on a CPU node; weight_sync_s is cpu_weight_sync_estimate's. Threads
    as the processes get them (primebuild/builders/processes.py): the trainer's ranks half the node's cores
    together, an inference server `inference.threads` or the other half."""
    threads = max(1, cpus_per_node // 2)
    serving = inference_threads or threads
    n = facts.matmul_params_per_token()
    per_token = 2 * n / (serving * CPU_FLOPS_PER_THREAD)
    per_sequence = per_token + (facts.num_layers * CPU_BATCH_INVARIANT_SEQ_LAYER_S if batch_invariant else 0.0)
    return Costs(
        decode_step_s=lambda batch, context: CPU_DECODE_STEP_OVERHEAD_S + batch * per_sequence,
        prefill_s_per_token=per_token,
        turn_overhead_s=CPU_TURN_OVERHEAD_S,
        request_s=CPU_REQUEST_S,  # the embedded engine and its server share the process's cores
        train_s=lambda sequences, tokens: CPU_TRAIN_STEP_OVERHEAD_S + 6 * n * sequences * tokens / (
            threads * CPU_TRAIN_FLOPS_PER_THREAD),
        weight_sync_s=CPU_WEIGHT_UPDATE_HANDOFF_S + weight_sync_s)


@dataclass(frozen=True)
class Split:
    inference_nodes: int
    trainer_nodes: int
    inference_replicas: int
    times: StepTimes  # the worst case (full-length rollouts)
    step_seconds: float  # what the split was chosen by: the expected step when a profile says, else the worst


def suggest_split(
    facts: ModelFacts,
    *,
    total_nodes: int,
    gpus_per_inference_replica: int,
    gpu: GpuSpec | str,
    min_inference_nodes: int = 1,
    min_trainer_nodes: int = 1,
    trainer_fits: Callable[[int], bool] | None = None,
    expected_step: Callable[[int, int, int], float] | None = None,
    **step_kwargs,
) -> Split:
    """The whole-node inference:trainer split with the shortest step (ties: fewer inference nodes).

    Tries every split with at least min_* nodes per side; inference nodes hold as many replicas of
    gpus_per_inference_replica GPUs as fit. step_kwargs go to step_time_estimate (everything but the
    GPU counts and replicas, which this function chooses). trainer_fits(trainer_gpus), when given, rules
    out splits whose trainer does not fit in memory (e.g. a closure over trainer_memory_per_gpu).
    expected_step(inference_gpus, replicas, trainer_gpus), when given (a rollout profile), is the step time
    the splits are compared by instead of the worst case.
    """
    spec = _gpu(gpu)
    best: Split | None = None
    for inference_nodes in range(max(1, min_inference_nodes), total_nodes - max(1, min_trainer_nodes) + 1):
        inference_gpus = inference_nodes * spec.gpus_per_node
        prefill = step_kwargs.get("prefill_gpus", 0)
        replicas = (inference_gpus - prefill) // gpus_per_inference_replica
        trainer_gpus = (total_nodes - inference_nodes) * spec.gpus_per_node
        if replicas < 1 or (trainer_fits is not None and not trainer_fits(trainer_gpus)):
            continue
        # GPUs left over after whole replicas idle: count only those that serve
        times = step_time_estimate(
            facts, inference_gpus=replicas * gpus_per_inference_replica + prefill, inference_replicas=replicas,
            trainer_gpus=trainer_gpus, gpu=spec, **step_kwargs,
        )
        seconds = times.step_seconds if expected_step is None else expected_step(
            replicas * gpus_per_inference_replica + prefill, replicas, trainer_gpus)
        candidate = Split(inference_nodes, total_nodes - inference_nodes, replicas, times, seconds)
        if best is None or seconds < best.step_seconds * (1 - 1e-9):
            best = candidate
    if best is None:
        raise UserError(f"no inference:trainer split of {total_nodes} nodes fits "
                        f"(replicas of {gpus_per_inference_replica} GPUs, ≥ {min_inference_nodes} inference "
                        f"and ≥ {min_trainer_nodes} trainer nodes, trainer fitting in memory)",
                        hint="add nodes or use smaller inference replicas")
    return best


__all__ = [
    "StepTimes", "Split", "WeightSyncEstimate", "attention_forward_flops", "cpu_costs", "gpu_costs", "decode_step_seconds", "distinct_experts",
    "kv_read_bytes", "prefill_seconds_per_token", "step_time_estimate", "suggest_split", "train_step_seconds",
    "weight_sync_estimate", "cpu_weight_sync_estimate",
]
