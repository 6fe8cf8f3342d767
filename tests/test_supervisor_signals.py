"""SIGTERM to the process supervising a run (`primebuild stop --now`, a kill): the run ends with a recorded
outcome and a message, where Python's default ended the process on the spot (no outcome.json, no word).
A handler of its own (the Slurm job's: SIGTERM there asks for a checkpoint first) is left alone."""

from __future__ import annotations

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
