"""Where a restarted Slurm job may go after its last attempt lost contact with a host.

The in-job supervisor notices a cut link within LOST_AFTER_S (slurm_hosts.py); slurmctld marks the node
down only after SlurmdTimeout (300 s by default), so a job submitted at once may be given that node again.
A restart (`primebuild run --max-restarts N`) therefore excludes the lost hosts' nodes when the partition
has enough other responding nodes for the whole job; when it has not, excluding them would leave the job
pending for ever, so it waits until every lost host's slurmd answers again, saying so every WAIT_REPORT_S.
"""

from __future__ import annotations

import socket
import subprocess
import time

from primebuild.builders.render.slurm import allocations
from primebuild.contracts.plan import Plan
from primebuild.manifest.schema import SlurmTarget as SlurmSettings
from primebuild.runtime.targets.base import Echo
from primebuild.runtime.targets.slurm_hosts import CONNECT_TIMEOUT_S, PROBE_EVERY_S, slurmd_endpoints

WAIT_REPORT_S = 30.0
# sinfo's compact states (%t) and suffixes no new job gets: "drng" is draining (its jobs finish, no new one starts)
NOT_USABLE = ("*", "down", "drain", "drng", "fail", "maint", "unk")


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def nodes_at(addresses: tuple[str, ...]) -> list[str]:
    """The names of the nodes at `addresses` (NodeAddr, NodeHostName or the name itself)."""
    if not addresses:
        return []
    shown = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, timeout=30)
    return [f["NodeName"] for f in map(_fields, shown.stdout.splitlines())
            if {f.get("NodeName"), f.get("NodeAddr"), f.get("NodeHostName")} & set(addresses)]


def usable_nodes(partition: str | None) -> list[str]:
    """The partition's nodes (the default partition's when None) that a job could be given now."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %t"] + (["-p", partition] if partition else [])
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    default = None if partition else _default_partition()
    rows = [line.split() for line in shown.stdout.splitlines() if line.strip()]
    if default is not None:
        members = subprocess.run(["sinfo", "-h", "-N", "-p", default, "-o", "%N"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
        rows = [r for r in rows if r[0] in members]
    return usable(rows)


def usable(rows: list[list[str]]) -> list[str]:
    """The names of sinfo's (name, compact state) rows whose state a new job can be given."""
    return sorted({name for name, state in rows if not any(bad in state for bad in NOT_USABLE)})


def _default_partition() -> str | None:
    shown = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    marked = [p.rstrip("*") for p in shown.stdout.split() if p.endswith("*")]
    return marked[0] if marked else None


def _answers(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def nodes_to_exclude(plan: Plan, lost_hosts: tuple[str, ...], echo: Echo) -> list[str]:
    """The nodes this submission must avoid: the lost hosts' when the rest can hold the job; otherwise
    none, after waiting until every lost host's slurmd answers again."""
    lost_nodes = nodes_at(lost_hosts)
    if not lost_nodes:
        return []
    needed = sum(len(a.component.nodes) for a in allocations(plan))
    partition = plan.target_settings(SlurmSettings).partition
    others = [n for n in usable_nodes(partition) if n not in lost_nodes]
    what = f"node(s) {', '.join(lost_nodes)} ({', '.join(lost_hosts)}, lost contact in the last attempt)"
    if len(others) >= needed:
        echo(f"the restarted job avoids {what}: {len(others)} other node(s) can hold its {needed}")
        return lost_nodes
    endpoints = slurmd_endpoints(lost_nodes)
    echo(f"the restarted job needs {needed} node(s) and only {len(others)} other(s) respond: waiting for {what} "
         f"to answer again")
    started = last_report = time.monotonic()
    while not all(_answers(a, p) for a, p in endpoints.items()):
        time.sleep(PROBE_EVERY_S)
        if time.monotonic() - last_report >= WAIT_REPORT_S:
            last_report = time.monotonic()
            echo(f"still waiting for {what} to answer ({last_report - started:.0f} s)")
    echo(f"{', '.join(lost_hosts)} answers again after {time.monotonic() - started:.0f} s: submitting")
    return []
