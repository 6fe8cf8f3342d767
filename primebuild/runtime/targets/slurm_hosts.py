"""Per-host liveness inside a Slurm job: can the batch host still reach every node the run's steps run on?

A cut link leaves the processes on the far side running and the shared filesystem readable, so neither
an exit status nor a file heartbeat notices it; slurmctld does, but only after SlurmdTimeout (300 s by
default). The signal has to cross the network: every node of the job runs slurmd, listening on its
port (SlurmdPort, or the node's own Port=), so the in-job supervisor TCP-connects to each node's slurmd
every PROBE_EVERY_S and counts a host lost after MISSES connections in a row went unanswered
(LOST_AFTER_S in all). Nothing to configure, on any cluster; the cost is two or three error lines in
slurmd's log per probe at its default level ("Zero Bytes were transmitted or received": a connection that
sends no request).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time

PROBE_EVERY_S = 5.0
CONNECT_TIMEOUT_S = 2.0
MISSES = 3  # in a row: one slow accept on a busy node is no lost host
LOST_AFTER_S = int(PROBE_EVERY_S * MISSES)
DEFAULT_SLURMD_PORT = 6818


def _fields(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def slurmd_endpoints(node_names: list[str]) -> dict[str, int]:
    """Each node's address and its slurmd's port, as `scontrol show node` gives them."""
    default = None
    endpoints: dict[str, int] = {}
    for name in node_names:
        shown = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=30)
        fields = _fields(shown.stdout)
        port = fields.get("Port")
        if not port or port == "0":
            if default is None:
                config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
                found = [line.split("=", 1)[1].strip() for line in config.stdout.splitlines()
                         if line.startswith("SlurmdPort")]
                default = int(found[0]) if found else DEFAULT_SLURMD_PORT
            port = str(default)
        endpoints[fields.get("NodeAddr", name)] = int(port)
    return endpoints


class HostWatch:
    """Probes each address's slurmd in a thread; `lost(address)` once MISSES probes in a row failed."""

    def __init__(self, endpoints: dict[str, int]):
        self.endpoints = endpoints
        self.misses = dict.fromkeys(endpoints, 0)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="slurm-host-watch")

    def start(self) -> HostWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def lost(self, address: str) -> bool:
        return self.misses.get(address, 0) >= MISSES

    def message(self, address: str) -> str | None:
        if not self.lost(address):
            return None
        return (f"lost contact with host {address} ({MISSES} connections to its slurmd at port "
                f"{self.endpoints[address]} in a row, over {LOST_AFTER_S} s, went unanswered)")

    def _loop(self) -> None:
        due = time.monotonic()
        while not self.stopped.wait(max(0.0, due - time.monotonic())):
            due += PROBE_EVERY_S  # a probe that waits out its timeout does not stretch the period
            for address, port in self.endpoints.items():
                try:
                    socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S).close()
                    self.misses[address] = 0
                except OSError:
                    self.misses[address] += 1
