"""SIGTERM to the process supervising a run (`primebuild stop --now`, a kill): the run ends with a recorded
outcome and a message, where Python's default ended the process on the spot (no outcome.json, no word).
A handler of its own (the Slurm job's: SIGTERM there asks for a checkpoint first) is left alone. And a health
answer counts only from the process the supervisor started."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, signal, time
from primebuild.runtime.supervisor import Terminated, _terminate_raises

try:
    with _terminate_raises():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    print("not raised")
except Terminated:
    print("raised")
print("default again" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else "handler left behind")
seen = []
signal.signal(signal.SIGTERM, lambda *_: seen.append(True))
with _terminate_raises():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
print("own handler kept" if seen else "own handler replaced")
"""


def test_sigterm_while_watching_ends_the_watch_and_keeps_a_handler_of_its_own():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["raised", "default again", "own handler kept"], done.stdout


def test_a_port_held_by_another_program_is_not_this_process_listening():
    """Two runs started a moment apart on one port: the second run's health check got 200 from the first
    run's server and took it for its own (it then sampled from the other run's model)."""
    import socket

    from conftest import free_port

    from primebuild.runtime.targets.local import LocalHandle

    port = free_port()
    listener = (f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); print('up', flush=True); "
                "time.sleep(60)")
    own = LocalHandle([sys.executable, "-c", listener], env=dict(os.environ))
    try:
        assert next(own.lines()) == "up\n"
        assert own.listens_on(port) is True
    finally:
        own.kill()
        own.wait(10)
    bystander = LocalHandle([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ))
    other_run = socket.create_server(("127.0.0.1", port))  # held by this test process, not by the handle
    try:
        assert bystander.listens_on(port) is False
        assert bystander.listens_on(free_port()) is None  # nobody listens: it cannot tell
    finally:
        other_run.close()
        bystander.kill()
        bystander.wait(10)
