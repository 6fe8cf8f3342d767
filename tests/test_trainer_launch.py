"""primebuild/runtime/trainer/launch.py across "hosts": two launcher nodes on two loopback addresses (127.0.0.2 and
127.0.0.3, as the ssh and Slurm CI nodes use), real torchrun and gloo ranks, one all_reduce over both.
Every socket they listen on is bound to a node's own address, never to every interface."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import listening_sockets
from conftest import free_port

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.hang_watchdog import run_processes
from primebuild.runtime.stacks import PROCESS_ENV, RUN_DIR_ENV

pytestmark = pytest.mark.timeout(240)

_RANK = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
folder = Path(sys.argv[1])
(folder / f"ready-{dist.get_rank()}").write_text(str(total.item()))
while not (folder / "done").exists():
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


def test_two_nodes_rendezvous_on_their_own_addresses(tmp_path: Path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = free_port("127.0.0.2")
    env = {**os.environ, RUN_DIR_ENV: str(tmp_path), PROCESS_ENV: "trainer", "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "primebuild.runtime.trainer.launch", "--nnodes", "2", "--node-rank", str(rank),
         "--master-addr", "127.0.0.2", "--master-port", str(port), "--bind", bind, "--",
         "--nproc-per-node", "1", str(script), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank, bind in enumerate(("127.0.0.2", "127.0.0.3"))]
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), \
                "".join(n.communicate()[0] for n in nodes if n.poll() is not None)
            time.sleep(0.2)
        sockets = listening_sockets([p.pid for p in run_processes(RunDir(tmp_path))])
        (tmp_path / "done").touch()
        outputs = [n.communicate(timeout=60)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert [(tmp_path / f"ready-{r}").read_text() for r in (0, 1)] == ["3.0", "3.0"]  # 1 + 2 over both nodes
    assert (nodes[0].pid, "127.0.0.2", port) in sockets, sockets  # node 0's launcher hosts the rendezvous
    assert not [s for s in sockets if s[1] in ("0.0.0.0", "::")], sockets
    assert {s[1] for s in sockets} <= {"127.0.0.1", "127.0.0.2"}, sockets  # gloo: lo's address


def test_a_rendezvous_port_the_run_before_still_holds_is_waited_for_then_refused(capfd):
    import socket
    import threading

    from primebuild.runtime.trainer.launch import _bind

    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    threading.Timer(1.0, held.close).start()  # the ending run's store lets go of it
    _bind("127.0.0.1", port, patience_s=20).close()
    assert capfd.readouterr().err.count("is in use; waiting up to 20 s") == 1

    with socket.create_server(("127.0.0.1", 0)) as still_held:
        started = time.monotonic()
        with pytest.raises(OSError, match="in use"):
            _bind("127.0.0.1", still_held.getsockname()[1], patience_s=1)
        assert time.monotonic() - started < 10
