"""The elastic set of inference servers the orchestrator samples from.

Each server is in one state:
- joining   listed by the supervisor (`primebuild scale --inference +1`), not yet up or not yet on the
            current weights: it gets no request;
- active    up and on the current policy version: requests go to the active servers in turn;
- down      a request or a weight update found it gone (killed, restarting): its in-flight requests
            are sent again to another active server, and it gets no new one until it is back;
- draining  the supervisor retires it (`scale --inference -1`): no new request, the in-flight ones finish;
- drained   nothing in flight any more: the supervisor may stop it.

A joining or down server is revived by `revive()`: once its /health answers, it is brought to the
current policy version (loaded like any update) and only then becomes active. So losing a replica costs
the run its share of the throughput while the plan's restart policy brings it back, never the run.

The supervisor's list (run folder: inference_pool.json) may add servers or mark them draining; servers
of the orchestrator's own config that the list does not name (a P/D router) stay as they are. This
module reports every server's state and request count back in inference_pool_state.json.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from primebuild.contracts.completion import NO_WHOLE_POLICY
from primebuild.contracts.run_dir import InferencePool, PoolState, RunDir, ServerState, write_json_atomic
from primebuild.runtime.orchestrator.client import InferenceClient, InferenceUnavailable, ServerGone

log = logging.getLogger("primebuild.orchestrator")
STATE_SECONDS = 0.5  # how often the supervisor's list is read and the state file rewritten (when changed)


@dataclass
class Server:
    url: str
    client: InferenceClient
    state: str = "active"
    in_flight: int = 0
    requests: int = 0
    joined_version: int | None = None
    versions: list[int] = field(default_factory=list)  # [lowest, highest] answered since it (re)joined

    def answered(self, version: int) -> None:
        self.requests += 1
        self.versions = [min(self.versions[0], version), max(self.versions[1], version)] if self.versions \
            else [version, version]


class ServerSet:
    def __init__(self, clients: list[InferenceClient], run: RunDir, make_client, retry_seconds: float):
        self.run = run
        self.make_client = make_client  # url -> InferenceClient, for a server the supervisor adds
        self.retry_seconds = retry_seconds
        self.servers: dict[str, Server] = {}
        for client in clients:
            client.fail_fast = True  # a gone server is this module's business: re-route, don't wait on it
            self.servers[client.base_url] = Server(client.base_url, client)
        self._turn = 0
        self._pool_mtime = None
        self._listed: set[str] | None = None  # the URLs of the supervisor's last list
        self._changed = asyncio.Event()  # a server became active
        self._state_written = None

    # --- what the orchestrator asks ------------------------------------------------------------

    def active(self) -> list[InferenceClient]:
        return [s.client for s in self.servers.values() if s.state == "active"]

    def all_clients(self) -> list[InferenceClient]:
        return [s.client for s in self.servers.values()]

    async def pick(self) -> Server:
        """The next active server in turn; waits (up to retry_seconds) while none is active."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_seconds
        while True:
            active = [s for s in self.servers.values() if s.state == "active"]
            if active:
                self._turn += 1
                return active[self._turn % len(active)]
            if loop.time() > deadline:
                raise InferenceUnavailable(f"no inference server answered for {self.retry_seconds:.0f} s: "
                                           + ", ".join(f"{s.url} ({s.state})" for s in self.servers.values()))
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=1.0)
            except TimeoutError:
                pass

    def gone(self, server: Server, err: ServerGone) -> None:
        if server.state == "active":
            log.warning("%s is gone (%s): its requests go to the other servers until it is back", server.url, err)
            server.state = "down"
        elif server.state == "draining":
            server.state = "drained"  # nothing of it left to finish

    def set_active(self, server: Server, version: int) -> None:
        server.state = "active"
        server.joined_version = version
        server.versions = []  # what it answered since it (re)joined
        self._changed.set()

    # --- the supervisor's list -----------------------------------------------------------------

    def reconcile(self) -> None:
        """Follow inference_pool.json: add the servers it adds, drain those it retires."""
        self._forget_stopped()
        path = self.run.inference_pool
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._pool_mtime:
            return
        self._pool_mtime = mtime
        pool = InferencePool.model_validate_json(path.read_text())
        draining = {s.url.rstrip("/") for s in pool.servers if s.name in pool.draining}
        for entry in pool.servers:
            url = entry.url.rstrip("/")
            if url not in self.servers:
                log.info("server %s (%s) joins: it gets requests once it serves the current weights", entry.name, url)
                client = self.make_client(url)
                client.fail_fast = True
                self.servers[url] = Server(url, client, state="joining")
            if url in draining and self.servers[url].state not in ("draining", "drained"):
                log.info("server %s (%s) is retired: draining %d request(s) in flight", entry.name, url,
                         self.servers[url].in_flight)
                self.servers[url].state = "draining"
        self._listed = {s.url.rstrip("/") for s in pool.servers}
        self._forget_stopped()

    def _forget_stopped(self) -> None:
        """A drained or joining server the supervisor no longer lists was stopped: forget it."""
        if self._listed is None:
            return
        for url, server in list(self.servers.items()):
            if server.state in ("drained", "joining") and url not in self._listed:
                del self.servers[url]
                asyncio.ensure_future(server.client.close())

    def settle_drains(self) -> None:
        for server in self.servers.values():
            if server.state == "draining" and server.in_flight == 0:
                server.state = "drained"

    def write_state(self) -> None:
        state = PoolState(servers={url: ServerState(state=s.state, requests=s.requests, joined_version=s.joined_version,
                                                    answered_versions=s.versions)
                                   for url, s in self.servers.items()})
        data = state.model_dump(mode="json")
        if data != self._state_written:
            write_json_atomic(self.run.inference_pool_state, data)
            self._state_written = data

    # --- bringing servers (back) in --------------------------------------------------------------

    async def revive(self, version: int, load) -> None:
        """Bring each joining or down server that answers again to `version` (`load(client, version)`),
        then let it take requests."""
        for server in [s for s in self.servers.values() if s.state in ("joining", "down")]:
            try:
                served = await server.client.version()
                # (a server with mixed weights needs a load even at version 0; under broadcast `load`
                # leaves it to the trainer's next update: main.py's revive_load)
                if served != version and (version > 0 or served == NO_WHOLE_POLICY):
                    await load(server.client, version)
            except (ServerGone, InferenceUnavailable):
                continue  # not back yet
            if server.state in ("joining", "down"):  # the supervisor did not retire it meanwhile
                log.info("%s serves policy version %d: it takes requests", server.url, version)
                self.set_active(server, version)
