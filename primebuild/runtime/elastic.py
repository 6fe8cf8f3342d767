"""The supervisor's side of an elastic inference pool: `primebuild scale RUN --inference +1 / -1`.

`scale` writes a request into the run folder (scale/request-<id>.json); the running supervisor picks
it up on its next tick and answers in scale/answer-<id>.json. A file, not an HTTP admin endpoint: the
supervisor serves nothing, the run folder is already the channel between a run and the commands
about it (STOP, status, logs), and whoever may write there may stop the run anyway.

+1  a new replica is a copy of the plan's last inference server with the plan's own rules for the
    next index: name inference-N, port = the first server's port + N (skipping a port this machine
    already holds), seed + N, the same node; with GPUs, as many free GPUs of a node as a replica has.
    Its worker reads scale/plan.json (the run's plan plus the added replicas; plan.json stays what
    was compiled). Once healthy it is listed in inference_pool.json; the orchestrator brings it to the
    current weights (the newest published step) before it gets a request (orchestrator/servers.py).
-1  the newest replica is marked draining in inference_pool.json; once the orchestrator reports it
    drained (nothing in flight), or after DRAIN_SECONDS, it is stopped and leaves the list. Its own
    /metrics (sequences finished, policy version) are read first and go into the answer.

Under broadcast weight sync an added replica joins the trainer's weight group with the next rank after
every server's; the trainer admits it at its next update, in full (weight_sync/membership.py), and the
orchestrator loads that update into it with the others. A retired one leaves the group as it stops.

Built for the local target and unsplit servers (embedded engine). Refused, with the reason: prefill/decode
splits (the router's server lists are fixed), vLLM servers, multi-node replicas, and the ssh / Slurm /
Kubernetes targets.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from dataclasses import dataclass

from primebuild.contracts.plan import HealthCheck, Plan, ProcessSpec, render_json
from primebuild.contracts.run_dir import (
    InferencePool,
    PoolServer,
    PoolState,
    RunDir,
    ScaleAnswer,
    ScaleRequest,
    write_json_atomic,
)

DRAIN_SECONDS = 60.0  # a retired replica's requests in flight may take this long to finish
SCALE_TARGETS = ("local",)


def scale_refusal(plan: Plan, target: str) -> str | None:
    """Why `scale` cannot change this run's inference pool, or None when it can."""
    if target not in SCALE_TARGETS:
        return (f"`scale` is built for the local target only; this run's target is {target} (its processes "
                "are started by the cluster's scheduler, whose allocation does not grow here)")
    if plan.by_role("prefill", "decode", "router"):
        return "`scale` is refused for a prefill/decode split: the router's server lists are fixed at start"
    servers = plan.by_role("inference")
    if any(p.environment == "vllm" for p in servers):
        return "`scale` is built for the embedded engine only; this run's servers are vLLM"
    if any("http" not in p.ports for p in servers):
        return "`scale` is refused for multi-node replicas"
    return None


def server_url(spec: ProcessSpec, hosts: list[str]) -> str:
    """The OpenAI base URL of a server, spelled as the orchestrator's endpoints are (primebuild/builders/processes.py)."""
    return f"http://{hosts[spec.node]}:{spec.ports['http']}/v1"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def new_replica(plan: Plan, index: int) -> ProcessSpec:
    """Replica `index` by the plan's rules (see the module's docstring); a UserError-free ValueError when
    no port or GPU is left."""
    servers = plan.by_role("inference")
    template, first = servers[-1], servers[0]
    taken = {port for p in plan.processes for port in p.ports.values()}
    port = first.ports["http"] + index
    while port in taken or not _port_free(port):
        port += 1
        if port > 65535:
            raise ValueError("no free port for a new inference server")
    gpus: list[int] = []
    node = template.node
    if template.gpus:
        node, gpus = _free_gpus(plan, len(template.gpus))
    config = template.config.model_copy(update={"port": port, "seed": template.config.seed - (len(servers) - 1)
                                                + index}) if template.config else None
    if config is not None and config.weight_broadcast is not None:
        # broadcast: the next weight-group rank after every server's, beyond the plan's (membership.py)
        rank = 1 + max(p.config.weight_broadcast.rank for p in servers if p.config and p.config.weight_broadcast)
        config = config.model_copy(update={"weight_broadcast": config.weight_broadcast.model_copy(
            update={"rank": rank})})
    health = HealthCheck(kind="http", url=template.health.url.rsplit(":", 1)[0] + f":{port}/health",
                         timeout_s=template.health.timeout_s)
    env = dict(template.env)
    if template.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return template.model_copy(update={"name": f"inference-{index}", "node": node, "gpus": gpus, "env": env,
                                       "ports": {"http": port}, "health": health, "config": config})


def _free_gpus(plan: Plan, count: int) -> tuple[int, list[int]]:
    per_node = plan.hardware.gpus_per_node
    for node in range(plan.hardware.nodes):
        used = {g for p in plan.processes if p.node == node for g in p.gpus}
        free = [g for g in range(per_node) if g not in used]
        if len(free) >= count:
            return node, free[:count]
    raise ValueError(f"no node has {count} free GPU(s) for a new inference replica")


@dataclass
class Join:
    name: str
    request_id: str
    deadline: float


@dataclass
class Drain:
    name: str
    request_id: str
    url: str
    deadline: float


class ElasticInference:
    """Owned by the supervisor: answers scale requests between its health checks (see the docstring)."""

    def __init__(self, supervisor, target: str = "local"):
        self.sup = supervisor
        self.run: RunDir = supervisor.run
        self.plan: Plan = supervisor.plan  # grows with each added replica (scale/plan.json)
        self.refusal = scale_refusal(supervisor.plan, target)
        self.added: set[str] = set()
        self.joining: list[Join] = []  # started, not healthy yet: the supervisor keeps watching meanwhile
        self.draining: list[Drain] = []
        self.answered: set[str] = set()
        self.retired: set[str] = set()  # stopped by `scale -1`, or added ones that never became healthy
        self.started = time.time()  # a request older than this supervisor was meant for an earlier session

    def plan_path_of(self, name: str):
        return self.run.scaled_plan if name in self.added else None

    def servers(self) -> list[ProcessSpec]:
        out = {d.name for d in self.joining} | self.retired
        return [p for p in self.plan.by_role("inference") if p.name not in out]

    def write_pool(self) -> None:
        if self.refusal is not None:
            return
        pool = InferencePool(servers=[PoolServer(name=p.name, url=server_url(p, self.sup.hosts)) for p in self.servers()],
                             draining=[d.name for d in self.draining])
        write_json_atomic(self.run.inference_pool, pool.model_dump(mode="json"))

    # --- each tick -------------------------------------------------------------------------------

    def poll(self) -> None:
        self._settle_joins()
        self._settle_drains()
        if not self.run.scale.is_dir():
            return
        for path in sorted(self.run.scale.glob("request-*.json")):
            request_id = path.stem.removeprefix("request-")
            if request_id in self.answered or self.run.scale_answer(request_id).exists():
                continue
            self.answered.add(request_id)
            if path.stat().st_mtime < self.started:
                self._answer(request_id, False, "the run was restarted before this request was answered: ask again")
                continue
            try:
                request = ScaleRequest.model_validate_json(path.read_text())
            except ValueError as err:
                self._answer(request_id, False, f"unreadable scale request: {err}")
                continue
            if self.refusal is not None:
                self._answer(request.id, False, self.refusal)
            elif request.inference > 0:
                self._add(request.id)
            elif request.inference < 0:
                self._retire(request.id)
            else:
                self._answer(request.id, False, "--inference must be +1 or -1")

    def _answer(self, request_id: str, ok: bool, message: str) -> None:
        self.sup.echo(f"scale: {message}")
        write_json_atomic(self.run.scale_answer(request_id), ScaleAnswer(ok=ok, message=message).model_dump(mode="json"))

    def _add(self, request_id: str) -> None:
        index = len(self.plan.by_role("inference"))  # names are never reused: logs and configs stay apart
        try:
            spec = new_replica(self.plan, index)
        except ValueError as err:
            self._answer(request_id, False, str(err))
            return
        self.plan = self.plan.model_copy(update={"processes": [*self.plan.processes, spec]}).hashed()
        self.run.scaled_plan.write_text(render_json(self.plan))
        self.added.add(spec.name)
        self.sup.running[spec.name] = self.sup._spawn(spec)
        self.joining.append(Join(spec.name, request_id, time.monotonic() + spec.health.timeout_s))
        self.sup.echo(f"scale: starting {spec.name} on port {spec.ports['http']}")

    def _settle_joins(self) -> None:
        """A started replica that answers its health check is listed for the orchestrator."""
        for join in list(self.joining):
            running = self.sup.running.get(join.name)
            healthy = running is not None and self.sup._healthy(running, time.monotonic() + 0.5)
            if not healthy and running is not None and time.monotonic() < join.deadline \
                    and running.handle.poll() is None:
                continue
            self.joining.remove(join)
            if not healthy:
                self.retired.add(join.name)
                if running is not None:
                    self.sup.running.pop(join.name)
                    self.sup._reap(running)
                self._answer(join.request_id, False, f"{join.name} did not become healthy; see {self.run.log(join.name)}")
                continue
            self.write_pool()
            self._answer(join.request_id, True, f"added {join.name} on port {running.spec.ports['http']}: it takes "
                         "requests once the orchestrator has loaded the current weights into it")

    def _retire(self, request_id: str) -> None:
        retiring = {d.name for d in self.draining}
        candidates = [p for p in self.servers() if p.name not in retiring]  # a joining one is not listed yet
        if len(candidates) <= 1:
            self._answer(request_id, False, "the run keeps at least one inference server: nothing retired")
            return
        spec = candidates[-1]
        self.sup.echo(f"scale: draining {spec.name}")
        self.draining.append(Drain(spec.name, request_id, server_url(spec, self.sup.hosts),
                                   time.monotonic() + DRAIN_SECONDS))
        self.write_pool()

    def _settle_drains(self) -> None:
        if not self.draining:
            return
        state = self._pool_state()
        for drain in list(self.draining):
            seen = state.servers.get(drain.url) if state else None
            drained = seen is not None and seen.state == "drained"
            if not drained and time.monotonic() < drain.deadline:
                continue
            served = self._served(drain.name)
            running = self.sup.running.pop(drain.name, None)
            if running is not None:
                if running.probe:
                    running.probe.stop()
                running.handle.terminate()
                if running.handle.wait(10.0) is None:
                    running.handle.kill()
                self.sup._reap(running)
            self.draining.remove(drain)
            self.retired.add(drain.name)
            self.write_pool()
            how = "drained" if drained else f"not drained within {DRAIN_SECONDS:.0f} s (its requests are re-routed)"
            self._answer(drain.request_id, True, f"retired {drain.name}, {how}; it served {served}")

    def _pool_state(self) -> PoolState | None:
        try:
            return PoolState.model_validate_json(self.run.inference_pool_state.read_text())
        except (OSError, ValueError):
            return None

    def _served(self, name: str) -> str:
        """What the server's own /metrics say it did: sequences finished, and the policy version it serves."""
        spec = self.plan.process(name)
        url = self.sup.health_url(spec).rsplit("/", 1)[0] + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (the run's own server)
                text = response.read().decode()
        except OSError as err:
            return f"(its /metrics did not answer: {err})"
        values = {}
        for line in text.splitlines():
            for key in ("sequences_finished_total", "policy_version"):
                if line.startswith(f"primebuild_inference_{key}{{"):
                    values[key] = float(line.rsplit(" ", 1)[1])
        return (f"{values.get('sequences_finished_total', 0):.0f} sequences, at policy version "
                f"{values.get('policy_version', -1):.0f}")
