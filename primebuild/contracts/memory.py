"""The plan's `memory` section: the budget of one GPU of each group (one process on a CPU node), from the
formulas in primebuild/builders/memory.py. Keyed by group: the inference groups by name, and `trainer`."""

from __future__ import annotations

from primebuild.contracts.base import Contract


class InferenceBreakdown(Contract):
    weights: int
    activations: int
    overhead: int
    kv_cache: int
    weight_staging: int  # broadcast: the buckets a worker holds while it loads an update (+ delta's copy on CPU)


class TrainerBreakdown(Contract):
    params: int
    grads: int
    optimizer_state: int
    master_weights: int
    fsdp_buffers: int
    activations: int
    logits: int
    sparse_index: int
    overhead: int


class OrchestratorBreakdown(Contract):
    process: int  # the orchestrator itself (asyncio, tokenizer, rollout buffers)
    supervisor: int  # `primebuild run` and its watchdog, where they run on this node (local target, Slurm's batch host)
    episode_programs: int  # agent harness programs and sandboxed commands of the episodes in flight at once
    router: int = 0  # the P/D router, where it runs on this node (embedded P/D; vLLM P/D on a one-node plan)


class _GroupMemory(Contract):
    role: str
    capacity_bytes: int
    budget_bytes: int
    used_bytes: int
    free_bytes: int
    fits: bool


class InferenceGroupMemory(_GroupMemory):
    breakdown: InferenceBreakdown
    kv_bytes_per_token: int
    kv_tokens_capacity: int  # tokens this GPU's cache holds
    max_concurrent_seqs: int  # full-length sequences the cache holds at once


class TrainerGroupMemory(_GroupMemory):
    breakdown: TrainerBreakdown
    host_offload_bytes_per_gpu: int  # optimizer.cpu_offload: what each rank keeps in host memory
    tokens_per_gpu: int


class OrchestratorGroupMemory(_GroupMemory):
    """Host memory of the orchestrator's node taken by primebuild's CPU processes there."""

    breakdown: OrchestratorBreakdown
    programs_in_flight: int  # episodes whose programs may run at once (training groups in flight + one eval)


# The shapes have different keys (and contracts forbid unknown ones), so the JSON says which it is.
GroupMemory = InferenceGroupMemory | TrainerGroupMemory | OrchestratorGroupMemory
