"""The ports a plan's processes listen on: each a real TCP port, and no two on one host.

Most ports derive from a few manifest fields (inference.port: the servers', their KV inboxes, NIXL side
channels, the data-parallel coordinators, the router and the teacher after them; weight_sync.port;
trainer.rendezvous_port). A derived port past 65535, or two processes of one plan node on one port, would
only fail at run time ("address already in use" after the trainer's restarts): the plan refuses them here,
at the field that set the port.
"""

from __future__ import annotations

from primebuild.contracts.plan import ProcessSpec
from primebuild.errors import Problem
from primebuild.manifest.schema import Manifest

HIGHEST_PORT = 65535
# a port's purpose (ProcessSpec.ports' key, or its config's field) -> the manifest field it derives from
FIELD_OF = {"weight_broadcast": "weight_sync.port", "rendezvous": "trainer.rendezvous_port",
            "rendezvous_port": "trainer.rendezvous_port"}  # else inference.port


def field_of(purpose: str) -> str:
    return FIELD_OF.get(purpose, "inference.port")


def out_of_range(port: int, purpose: str) -> Problem:
    field = field_of(purpose)
    what = purpose.removesuffix("_port").removesuffix("port").strip("_") or "server"
    return Problem(f"the {what} port derived from it is {port}, past the highest TCP port {HIGHEST_PORT}", field=field,
                   hint=f"lower {field} by at least {port - HIGHEST_PORT}")


def port_problems(m: Manifest, processes: list[ProcessSpec]) -> list[Problem]:
    """Ports past 65535, and two listeners on one port of one plan node (the later one's field named)."""
    problems: list[Problem] = []
    taken: dict[tuple[int, int], tuple[str, str]] = {}  # (node, port) -> (process, purpose)
    for p in processes:
        for purpose, port in p.ports.items():
            if port > HIGHEST_PORT:
                problems.append(out_of_range(port, purpose))
                continue
            if port <= 0:
                continue  # 0: the kernel picks one
            other = taken.setdefault((p.node, port), (p.name, purpose))
            if other != (p.name, purpose):
                field = field_of(purpose)
                problems.append(Problem(f"{p.name}'s {purpose} port {port} is also {other[0]}'s {other[1]} "
                                        f"port on plan node {p.node}: the second to start would fail with "
                                        "'address already in use'", field=field,
                                        hint=f"choose a {field} whose ports do not meet {other[0]}'s"))
    return problems
