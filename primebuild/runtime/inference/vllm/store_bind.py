"""vLLM 0.32.0's coordination TCPStores listen on the host they are given, not on every interface (loaded by
r3_plugin.py in each vLLM process, on every platform).

Why: with data parallelism (`inference.dp > 1`, and every P/D pool of glm5) vLLM opens master TCPStores
through `vllm.distributed.utils.create_tcp_store(host, 0, is_master=True, ...)`: the API server's DP
coordination store (vllm/v1/engine/utils.py) and rank 0's world-group store (distributed/parallel_state.py).
Without a `listen_socket`, torch's TCPStore server binds the port on every interface (`*:port` in
`ss -ltn`), so a server the manifest keeps on loopback held a port open to the whole network, inherited
by its engine cores and workers. The trainer's rendezvous and the weight-broadcast store had the same
problem and hand TCPStore a socket bound to their address (trainer/launch.py, weight_sync/membership.py);
this does the same for vLLM's: a master store with no socket of its own gets one bound to `host`.
"""

from __future__ import annotations

import functools
import socket
import sys

_PATCHED = "_primebuild_store_bind"


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (a name or an address) and `port` (0: any free one)."""
    return socket.create_server((host, port), backlog=1024)


def bind_to_host(create_tcp_store):
    """`create_tcp_store` whose master stores listen on their host only."""

    @functools.wraps(create_tcp_store)
    def create_bound_tcp_store(host: str, port: int, listen_socket: socket.socket | None = None, **kwargs):
        if listen_socket is None and kwargs.get("is_master"):
            listen_socket = bound_listener(host, port)
            port = listen_socket.getsockname()[1]  # the store reports the port it listens on
        return create_tcp_store(host, port, listen_socket, **kwargs)

    setattr(create_bound_tcp_store, _PATCHED, True)
    return create_bound_tcp_store


def register() -> None:
    import vllm.distributed.utils as utils

    if getattr(utils.create_tcp_store, _PATCHED, False):
        return
    utils.create_tcp_store = bind_to_host(utils.create_tcp_store)
    # modules that imported the name before this plugin loaded hold the original: patch theirs too
    for name in ("vllm.distributed.parallel_state",):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "create_tcp_store"):
            module.create_tcp_store = utils.create_tcp_store
