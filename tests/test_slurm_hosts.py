"""The Slurm job's per-host liveness (primebuild/runtime/targets/slurm_hosts.py) on real sockets: a host whose
port accepts stays alive; one whose connections go unanswered is lost after MISSES probes in a row, and is
named as the ssh target names a lost host."""

from __future__ import annotations

import socket
import time

import pytest

from primebuild.runtime.targets import slurm_hosts


@pytest.fixture()
def fast(monkeypatch):
    monkeypatch.setattr(slurm_hosts, "PROBE_EVERY_S", 0.1)
    monkeypatch.setattr(slurm_hosts, "CONNECT_TIMEOUT_S", 0.5)


def test_a_host_that_stops_answering_is_lost_after_the_misses_and_one_that_answers_never(fast):
    listening = socket.create_server(("127.0.0.1", 0))
    answering = socket.create_server(("127.0.0.2", 0))
    watch = slurm_hosts.HostWatch({"127.0.0.1": listening.getsockname()[1],
                                   "127.0.0.2": answering.getsockname()[1]}).start()
    try:
        time.sleep(0.6)  # several probes: both answer
        assert not watch.lost("127.0.0.1") and not watch.lost("127.0.0.2")
        assert watch.message("127.0.0.1") is None
        listening.close()  # nothing listens there any more: each probe is refused
        deadline = time.monotonic() + 5
        while not watch.lost("127.0.0.1") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.lost("127.0.0.1") and not watch.lost("127.0.0.2")
        assert watch.message("127.0.0.1").startswith("lost contact with host 127.0.0.1 (3 connections to its slurmd")
    finally:
        watch.stop()
        answering.close()

