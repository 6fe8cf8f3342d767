"""Multi-host for real: three hosts as network namespaces (scripts/ci-hosts: 10.77.0.1-3, sshd in each,
one bridge), over the ssh target. Inference on hosts[0], a 2-node trainer on hosts[1] and hosts[2]
(torchrun's rendezvous and gloo across hosts, bound to each node's own address), the orchestrator
beside the last trainer node, weights by broadcast from the trainer's host to the server's. Only the
network is separate: the run folder is on the one filesystem every "host" sees, as a cluster's shared
/runs gives it. A link cut mid-run ends the run naming the host and the process, leaves nothing
running in any namespace, and `--resume` trains every step once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import (
    NAMESPACES,
    NETNS_HOSTS,
    REPO,
    cli,
    logs_tail,
    namespace_pids,
    processes_of,
    require_netns_hosts,
    start,
    trained_steps,
    wait_gone,
    wait_trained,
    where_the_run_is,
)
from conftest import SHIPPED_NAMES, sft_workspace

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
MANIFEST = "reverse-text-3hosts.yaml"
SMALL = ["--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory, short_sft_store):
    config = require_netns_hosts()
    for veth in NAMESPACES:  # a link a failed test left cut
        subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=20)
    root = tmp_path_factory.mktemp("netns")
    manifests = sft_workspace(root, SHIPPED_NAMES, seed_store=short_sft_store)
    shutil.copy(REPO / "tests" / "data" / MANIFEST, manifests / MANIFEST)
    workdir = root / "primebuild"
    workdir.symlink_to(REPO)  # the install every "host" runs, on the shared filesystem
    env = {**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PYTHONUNBUFFERED": "1",
           "PRIMEBUILD_SSH_CONFIG": str(config)}
    return manifests / MANIFEST, env, ["--set", f"target.workdir={workdir}"]


def _run_pids(run_dir: Path) -> list[int]:
    return [int(line.split(":")[0]) for line in processes_of(run_dir)]


def test_a_run_spans_three_hosts_then_a_cut_link_ends_it_naming_the_host_and_resume_trains_each_step_once(
        ws, tmp_path: Path):
    """One run for both: where its processes and sockets are while it trains, then the cut and the resume
    (each launch of a 3-host run costs ~40 s of CPU here)."""
    manifest, env, workdir = ws
    runs = tmp_path / "runs"
    proc = start("run", manifest, "--runs-dir", runs, "--quiet", *SMALL, *workdir,
                 "--set", "orchestrator.max_steps=6", "--set", "trainer.checkpoint_every=1", env=env)
    try:
        run_dir = wait_trained(runs, 2, proc, timeout=600)
        placed, sockets = where_the_run_is(run_dir, _run_pids(run_dir), NAMESPACES)
        subprocess.run(["ip", "link", "set", "pbhost2", "down"], check=True, timeout=20)  # trainer-n0's host
        cut = time.monotonic()
        out, _ = proc.communicate(timeout=180)
        ended = time.monotonic() - cut
        # nothing of the run is left on any host: each namespace's processes, and the whole machine
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(set(_run_pids(run_dir)) & namespace_pids(ns) for ns in NAMESPACES):
            time.sleep(0.5)
        gone = time.monotonic() - cut
        left = {ns: sorted(set(_run_pids(run_dir)) & namespace_pids(ns)) for ns in NAMESPACES}
    finally:
        subprocess.run(["ip", "link", "set", "pbhost2", "up"], check=True, timeout=20)
        if proc.poll() is None:
            proc.kill()
    print(out[-3000:])
    assert placed == {"inference-0": "pbhost1", "trainer-n0": "pbhost2", "trainer-n1": "pbhost3",
                      "orchestrator": "pbhost3"}, placed
    assert json.loads((run_dir / "rendezvous.json").read_text())["hosts"] == list(NETNS_HOSTS)
    # every socket of the run listens on its own host's address (loopback inside it at most), never `*`
    own = {ns: host for ns, host in zip(NAMESPACES, NETNS_HOSTS, strict=True)}
    wrong = [(pid, ns, addr, port) for pid, ns, addr, port in sockets if addr not in (own.get(ns), "127.0.0.1")]
    assert wrong == [], sockets
    listening = {(ns, addr, port) for _, ns, addr, port in sockets}
    assert ("pbhost2", "10.77.0.2", 29500) in listening  # the trainer's rendezvous, on node 0 of the trainer
    assert any(ns == "pbhost1" and addr == "10.77.0.1" for ns, addr, _ in listening)  # the server
    print(f"3 hosts: listening sockets {sorted(listening)}")
    print(f"link cut: `primebuild run` ended {ended:.1f} s after the cut; the last process of the run on any "
          f"host was gone {gone:.1f} s after it")
    assert proc.returncode != 0 and ended < 60, (ended, out)
    assert "lost contact with host 10.77.0.2" in out and "trainer-n0" in out, out
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["process"] == "trainer-n0" and "10.77.0.2" in failure["message"], failure
    assert left == {ns: [] for ns in NAMESPACES}, (left, processes_of(run_dir))
    assert wait_gone(run_dir, 10) == []
    done = trained_steps(run_dir)
    assert done == list(range(1, len(done) + 1)) and len(done) < 6, done

    resumed = cli("run", "--resume", run_dir, "--quiet", env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + logs_tail(run_dir)
    assert trained_steps(run_dir) == list(range(1, 7))  # each step exactly once, across two launches
    # the weights went by broadcast from hosts[1] to hosts[0]: no weight folders, the server got the last step
    assert "loaded the weights of step 6 from the broadcast" in (run_dir / "logs" / "inference-0.log").read_text()
    assert not (run_dir / "weights").exists() or not any((run_dir / "weights").iterdir())
    assert wait_gone(run_dir, 30) == []  # the next test binds the same rendezvous port on pbhost2


def test_a_run_on_one_remote_host_reaches_its_servers_at_that_hosts_address(ws, tmp_path: Path):
    """Every plan node on one host that is not this machine: the servers bind that host's address and the
    supervisor here reaches them there (they bound loopback on the remote host, and the health checks went to
    this machine's loopback: the run waited its whole health timeout in silence)."""
    manifest, env, workdir = ws
    host = NETNS_HOSTS[0]
    runs = tmp_path / "runs"
    done = cli("run", manifest.parent / "reverse-text-ssh.yaml", "--runs-dir", runs, "--quiet", *SMALL, *workdir,
               "--set", "hardware.nodes=1", "--set", f"target.hosts=[{host}]", "--set", "orchestrator.max_steps=3",
               env=env, timeout=400)
    (run_dir,) = runs.iterdir()
    assert done.returncode == 0, done.stdout + done.stderr + logs_tail(run_dir)
    assert json.loads((run_dir / "rendezvous.json").read_text())["hosts"] == [host]
    assert trained_steps(run_dir) == [1, 2, 3]
    assert wait_gone(run_dir, 30) == []
