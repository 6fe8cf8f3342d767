"""Where a restarted Slurm job goes after its last attempt lost a host (primebuild/runtime/targets/slurm_avoid.py),
against the real slurmctld of scripts/ci-services: the lost host's node is excluded when the partition's other
nodes can hold the job; when they cannot, the restart waits for the host to answer again, saying so."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from cluster_helpers import REPO, require_slurm
from conftest import SHIPPED_NAMES, plan_json, sft_workspace

from primebuild.builders.render.slurm import SCRIPT_NAME, render_slurm
from primebuild.contracts.plan import Plan
from primebuild.contracts.render import RenderContext
from primebuild.runtime.targets import slurm_avoid

pytestmark = pytest.mark.cluster
HOSTS_MANIFEST = REPO / "tests" / "data" / "reverse-text-slurm-hosts.yaml"  # 4 whole nodes of partition `hosts`


def _plan(root: Path, sets: tuple[str, ...] = ()) -> Plan:
    manifests = sft_workspace(root, SHIPPED_NAMES)
    shutil.copy(HOSTS_MANIFEST, manifests / HOSTS_MANIFEST.name)
    return Plan.model_validate(plan_json(manifests / HOSTS_MANIFEST.name, sets))


def test_the_lost_hosts_node_is_excluded_when_the_others_hold_the_job(tmp_path: Path):
    require_slurm()
    plan = _plan(tmp_path, ("target.partition=debug",))  # 5 loopback nodes, node1 at 127.0.0.11
    said: list[str] = []
    assert slurm_avoid.nodes_to_exclude(plan, ("127.0.0.11",), said.append) == ["node1"]
    assert "avoids node(s) node1 (127.0.0.11" in said[0], said
    # the script asks every het component to keep off it
    script = render_slurm(plan, RenderContext(run_dir="/runs/x", python="/py", exclude_nodes=["node1"]))[SCRIPT_NAME]
    components = script.count("#SBATCH --nodes=")
    assert components >= 3 and script.count("#SBATCH --exclude=node1\n") == components, script[:3000]
    assert "--exclude" not in render_slurm(plan, RenderContext(run_dir="/runs/x", python="/py"))[SCRIPT_NAME]


def test_without_enough_other_nodes_the_restart_waits_for_the_lost_host_to_answer(tmp_path: Path, monkeypatch):
    require_slurm()
    plan = _plan(tmp_path)  # needs all 4 nodes of `hosts`: excluding one would leave the job pending for ever
    lost = socket.socket()  # stands for host1's slurmd: bound, not yet listening, so connections are refused
    lost.bind(("127.0.0.1", 0))
    monkeypatch.setattr(slurm_avoid, "slurmd_endpoints", lambda nodes: {"127.0.0.1": lost.getsockname()[1]})
    monkeypatch.setattr(slurm_avoid, "PROBE_EVERY_S", 0.2)
    monkeypatch.setattr(slurm_avoid, "WAIT_REPORT_S", 0.5)
    threading.Timer(1.5, lost.listen).start()  # the link comes back
    said: list[str] = []
    started = time.monotonic()
    try:
        excluded = slurm_avoid.nodes_to_exclude(plan, ("10.77.0.1",), said.append)
    finally:
        lost.close()
    assert excluded == [] and time.monotonic() - started >= 1.5
    assert "needs 4 node(s) and only 3 other(s) respond: waiting for node(s) host1 (10.77.0.1" in said[0], said
    assert any(line.startswith("still waiting for node(s) host1") for line in said), said
    assert said[-1].startswith("10.77.0.1 answers again after"), said


def test_draining_and_drained_nodes_are_not_counted_usable():
    """sinfo's compact states: "drng" (draining: its jobs finish, no new job starts) counted as usable before."""
    from primebuild.runtime.targets.slurm_avoid import usable

    rows = [["n1", "idle"], ["n2", "drng"], ["n3", "drain"], ["n4", "mix"], ["n5", "down*"], ["n6", "alloc"]]
    assert usable(rows) == ["n1", "n4", "n6"]


def test_a_time_limit_within_the_stop_warning_is_refused_at_target_time(capsys):
    """--signal=B:TERM@120 under a 60 s limit: the job was told to stop as it started."""
    from conftest import MANIFESTS, call_cli

    result = call_cli(capsys, "plan", MANIFESTS / "reverse-text-slurm.yaml", "--set", "target.time=00:01:00")
    assert result.code == 2 and "target.time" in result.err and "within the stop warning" in result.err, result.text
    assert call_cli(capsys, "plan", MANIFESTS / "reverse-text-slurm.yaml", "--set", "target.time=1-00:00:00").code == 0
