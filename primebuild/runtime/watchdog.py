"""The watchdog: ends a run's processes when the `primebuild run` that owns them dies, even by SIGKILL.

`primebuild run` starts it first, in a session of its own, holding the write end of a pipe to its
stdin. A supervisor that ends normally writes "done" and closes the pipe; one that is killed closes it
by dying (the kernel closes its descriptors), and the watchdog reads EOF without "done": it then asks
the run's target to stop what is left (local and ssh: the process groups the workers recorded in
pids/; Slurm: scancel; Kubernetes: delete what was applied). Local workers also get SIGTERM from the
kernel when their supervisor dies (PR_SET_PDEATHSIG, primebuild/runtime/worker.py), which covers a worker started
a moment before its record was written.

    python -m primebuild.runtime.watchdog RUN_DIR   (stdin: the pipe)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from primebuild.contracts.run_dir import RunDir

SETTLE_SECONDS = 1.0  # let workers started just before the supervisor died write their pid records


class Watchdog:
    """The supervisor's side: start it, tell it when the run ended normally."""

    def __init__(self, run: RunDir):
        log = open(run.logs / "watchdog.log", "a")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen([sys.executable, "-m", "primebuild.runtime.watchdog", str(run.root)],
                                     stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def done(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"done\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def teardown(run: RunDir) -> str:
    from primebuild.contracts.plan import read_plan
    from primebuild.runtime.targets import target_for

    record = run.read_launch()
    if record is None:  # killed before launch finished: only local workers can exist, and they record pids
        from primebuild.contracts.run_dir import LaunchRecord

        record = LaunchRecord(target=read_plan(run.plan).target.kind)
    return target_for(record.target).stop(run, record)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for `primebuild run`
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    run = RunDir(Path(argv[0]))
    data = b""
    while True:
        chunk = os.read(0, 1024)
        if not chunk:
            break
        data += chunk
    if b"done" in data:
        return 0
    time.sleep(SETTLE_SECONDS)
    print(f"watchdog: the supervisor of {run.root} died; ending what is left", flush=True)
    try:
        print(f"watchdog: {teardown(run)}", flush=True)
    except Exception as err:  # noqa: BLE001 (a log line is all a watchdog can leave)
        print(f"watchdog: teardown failed: {type(err).__name__}: {err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
