"""The local target: every process of the plan on this machine, supervised by `primebuild run` itself."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.run_dir import LOOPBACK, LaunchRecord, Rendezvous, RunDir, write_json_atomic
from primebuild.errors import UserError
from primebuild.runtime.targets.base import Echo, Target
from primebuild.runtime.targets.processes import (
    ProcessHandle,
    belongs_to,
    end_groups,
    group_listens_on,
    process_identity,
)
from primebuild.runtime.worker import SUPERVISOR_PID_ENV


def worker_argv(python: str, run: RunDir, name: str, plan_path: Path | None = None) -> list[str]:
    return [python, "-m", "primebuild.cli", "worker", "--plan", str(plan_path or run.plan), "--process", name,
            "--run-dir", str(run.root)]


def write_rendezvous(run: RunDir, hosts: list[str]) -> None:
    """The node addresses a target resolved, with the model folder and the Python environments beside ours
    that `primebuild run` resolved (run.json)."""
    record = run.read_json(run.run_record)
    rendezvous = Rendezvous(hosts=hosts, model_path=record["model_path"], environments=record.get("environments", {}),
                            teacher_model_path=record.get("teacher_model_path"))
    write_json_atomic(run.rendezvous, rendezvous.model_dump(mode="json"))


class LocalHandle(ProcessHandle):
    """A plan process this supervisor started on this very host (not through srun or ssh): what holds its
    port can be checked here."""

    def listens_on(self, port: int) -> bool | None:
        """Does this process (or its engine, its workers) hold the socket listening on `port`? A health
        check that gets an answer from a port another program holds (another run's server, started a
        moment before) must not take it for this process's (supervisor._answered_by)."""
        return group_listens_on(self.pid, port)


class LocalLauncher:
    kind = "local"

    def __init__(self, run: RunDir):
        self.run = run

    def start(self, spec: ProcessSpec, env: dict[str, str], plan_path: Path | None = None) -> ProcessHandle:
        """`plan_path`: where the process is described when not in the run's plan (a replica `scale` added)."""
        # The worker asks the kernel for SIGTERM when this process dies (primebuild/runtime/worker.py).
        full = {**os.environ, **env, SUPERVISOR_PID_ENV: str(os.getpid())}
        return LocalHandle(worker_argv(sys.executable, self.run, spec.name, plan_path), full)


class SupervisedHere:
    """A target whose supervisor runs in this process (`primebuild run` itself): launch starts it, with the
    target's launcher starting the processes, and follow watches it until the run ends."""

    kind: str

    def __init__(self):
        self.supervisor = None
        self.start_failure = None

    def _start_supervisor(self, run: RunDir, plan: Plan, launcher, *, echo: Echo, verbosity: int,
                          live) -> LaunchRecord:
        from primebuild.runtime.supervisor import Supervisor

        self.supervisor = Supervisor(plan, run.root, launcher, echo=echo, verbosity=verbosity, live=live)
        try:
            self.start_failure = self.supervisor.start()
        except BaseException:
            self.supervisor.stop_all()
            raise
        return LaunchRecord(target=self.kind, supervisor_host=socket.gethostname(), supervisor_pid=os.getpid(),
                            supervisor_identity=process_identity(os.getpid()))

    def _watch(self):
        """The run's outcome: the start's failure, or what the supervisor saw; anything else ends the run."""
        supervisor = self.supervisor
        assert supervisor is not None, "follow() after launch() in the same process"
        if self.start_failure is not None:
            return self.start_failure
        try:
            return supervisor.watch()
        except BaseException:
            supervisor.stop_all()
            raise


class LocalTarget(SupervisedHere, Target):
    kind = "local"

    def provision(self, plan: Plan) -> None:
        from primebuild.runtime.supervisor import ports_in_use, ports_message

        busy = ports_in_use(plan)
        if busy:  # before anything is built or written
            raise UserError(ports_message(busy))

    def launch(self, run: RunDir, plan: Plan, *, echo: Echo, verbosity: int, live=None,
               avoid_hosts: tuple[str, ...] = ()) -> LaunchRecord:
        write_rendezvous(run, [LOOPBACK] * plan.hardware.nodes)
        return self._start_supervisor(run, plan, LocalLauncher(run), echo=echo, verbosity=verbosity, live=live)

    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int):
        return self._watch()

    def active(self, run: RunDir, record: LaunchRecord) -> bool:
        return _supervisor_alive(record) or any(belongs_to(r.pgid, run) for r in run.process_records())

    def stop(self, run: RunDir, record: LaunchRecord) -> str:
        told = []
        if record.supervisor_pid != os.getpid() and _supervisor_alive(record):
            os.kill(record.supervisor_pid, signal.SIGTERM)  # it ends the workers and records the outcome
            told = [f"its supervisor (pid {record.supervisor_pid}) to end it"]
            time.sleep(0.5)
        here = socket.gethostname()
        ended = end_groups([r for r in run.process_records() if r.host == here], run)
        done = [f"asked {told[0]}"] if told else []
        done += [f"ended {', '.join(ended)}"] if ended else []
        return "; ".join(done) or "nothing of the run was running"

    def state(self, run: RunDir, record: LaunchRecord) -> str:
        return "local: running" if self.active(run, record) else "local: not running"


def _supervisor_alive(record: LaunchRecord) -> bool:
    """Is the recorded supervisor this very process still, on this host? A pid alone is not: the kernel
    reuses it (a dead run looked alive, and `stop` signalled whatever had the pid)."""
    if record.supervisor_pid is None or record.supervisor_host not in (None, socket.gethostname()):
        return False
    if record.supervisor_identity is not None:
        return process_identity(record.supervisor_pid) == record.supervisor_identity
    try:  # a record written before identities: the command line is all there is
        return b"primebuild" in open(f"/proc/{record.supervisor_pid}/cmdline", "rb").read()
    except OSError:
        return False
