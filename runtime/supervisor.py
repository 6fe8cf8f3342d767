"""The local target: start a plan's processes on this machine and watch them.

- Processes start in the plan's start order; each order waits until the previous ones are healthy
  (an HTTP health check, or simply alive).
- Every process is `primebuild worker --plan … --process NAME` in its own session; its output goes to
  logs/NAME.log. The terminal gets one progress line per step (from metrics.jsonl) and, prefixed with
  the process's name, the lines that ask for attention (warnings, errors, tracebacks); `verbose` adds
  every line (access logs, per-request lines), `quiet` keeps the progress alone.
- A process that dies is restarted when its restart policy says so; otherwise everything is torn down
  at once (fail fast) and the exit code names what failed.
- The run ends when the orchestrator exits 0 and the trainer has finished.
- Ctrl-C (or a STOP file in the run folder) asks the trainer to checkpoint and the orchestrator to stop, waits a bounded
  time, then stops everything; `primebuild run --resume RUN_DIR` continues from there.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from primebuild.contracts.inference import ADMIN_TOKEN_ENV
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.progress import Progress

GRACE_SECONDS = 60
QUIET, ATTENTION, VERBOSE = 0, 1, 2
# What a person must see on the terminal: log records at WARNING and above (every process logs with its
# level), tracebacks and `error:` lines. torch/transformers chatter, tqdm bars and access logs stay in logs/.
_ATTENTION = {"warnings": re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^Traceback|^error:|^\w+(Error|Exception): "),
              "errors": re.compile(r"\b(ERROR|CRITICAL)\b|^Traceback|^error:")}


@dataclass
class Running:
    spec: ProcessSpec
    popen: subprocess.Popen
    log: TextIO
    restarts: int = 0
    pump: threading.Thread | None = None


@dataclass
class Outcome:
    ok: bool
    message: str
    exit_code: int


class Supervisor:
    def __init__(self, plan: Plan, run_dir: Path, *, echo=print, verbosity: int = ATTENTION, live=None):
        self.plan = plan
        self.run = RunDir(run_dir)
        self.run_dir = run_dir
        self.echo = echo
        self.verbosity = verbosity
        self.stopping = False
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, Running] = {}
        self.lock = threading.Lock()
        # The admin token lives only in this process tree's environment: never in a file or a log.
        self.admin_token = secrets.token_urlsafe(24)
        self.progress = Progress(self.run.metrics, echo, live)

    # --- starting --------------------------------------------------------------------------------

    def _spawn(self, spec: ProcessSpec, restarts: int = 0) -> Running:
        name = spec.name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[ADMIN_TOKEN_ENV] = self.admin_token
        argv = [sys.executable, "-m", "primebuild.cli", "worker", "--plan", str(self.run.plan),
                "--process", name, "--run-dir", str(self.run_dir)]
        log = open(self.run.log(name), "a", buffering=1)  # noqa: SIM115 (closed in _reap)
        log.write(f"--- start {time.strftime('%Y-%m-%dT%H:%M:%S')} (restart {restarts}) ---\n")
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env, start_new_session=True, text=True, bufsize=1)
        running = Running(spec, popen, log, restarts)
        running.pump = threading.Thread(target=self._pump, args=(name, popen, log, _ATTENTION[spec.terminal]), daemon=True)
        running.pump.start()
        return running

    def _pump(self, name: str, popen: subprocess.Popen, log: TextIO, attention: re.Pattern) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            log.write(line)
            if self.stopping and self.verbosity != VERBOSE:
                continue  # what processes say while being torn down is in their logs
            if self.verbosity == VERBOSE or (self.verbosity == ATTENTION and attention.search(line)):
                self.echo(f"[{name}] {line.rstrip()}")

    def _healthy(self, running: Running, deadline: float) -> bool:
        health = running.spec.health
        while time.monotonic() < deadline:
            if running.popen.poll() is not None:
                return False
            if health.kind == "process":
                return True
            url = (health.url or "").replace("{host:" + str(running.spec.node) + "}", "127.0.0.1")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback only)
                    if response.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def start(self) -> Outcome | None:
        busy = ports_in_use(self.plan)
        if busy:
            return Outcome(False, ports_message(busy), 2)
        orders = sorted({p.start_order for p in self.plan.processes})
        for order in orders:
            group = [p for p in self.plan.processes if p.start_order == order]
            for spec in group:
                self.running[spec.name] = self._spawn(spec)
            for spec in group:
                if not self._healthy(self.running[spec.name], time.monotonic() + spec.health.timeout_s):
                    code = self.running[spec.name].popen.poll()
                    self.stop_all()
                    return Outcome(False, f"{spec.name} did not become healthy "
                                   f"({'exited with code ' + str(code) if code is not None else 'timed out'}); "
                                   f"see {self.run.log(spec.name)}", 1)
        return None

    # --- watching --------------------------------------------------------------------------------

    def watch(self) -> Outcome:
        interrupted = False
        stop_file = self.run.stop_file
        stop_deadline = None
        try:
            while True:
                try:
                    self.progress.poll()
                    outcome = self._check()
                    if outcome is not None:
                        return outcome
                    if stop_deadline is not None and time.monotonic() > stop_deadline:
                        self.stop_all()
                        return self._stopped()
                    time.sleep(0.2)
                except KeyboardInterrupt:
                    if interrupted:
                        self.stop_all()
                        return Outcome(False, "interrupted twice: stopped without waiting", 130)
                    interrupted = True
                    self.echo("stopping: the trainer checkpoints, then everything stops (Ctrl-C again to force)")
                    stop_file.touch()
                    stop_deadline = time.monotonic() + GRACE_SECONDS
        finally:
            self.progress.poll()

    def _check(self) -> Outcome | None:
        roles_done = {"orchestrator": False, "trainer": False}
        for name, running in list(self.running.items()):
            code = running.popen.poll()
            if code is None:
                continue
            role = running.spec.role
            if code == 0 and role in roles_done:
                roles_done[role] = True
                continue
            policy = running.spec.restart
            if code != 0 and policy.policy == "on-failure" and running.restarts < policy.max_restarts:
                self.echo(f"{name} exited with code {code}: restarting ({running.restarts + 1}/{policy.max_restarts})")
                self._reap(running)
                replacement = self._spawn(running.spec, running.restarts + 1)
                self.running[name] = replacement
                if not self._healthy(replacement, time.monotonic() + running.spec.health.timeout_s):
                    self.stop_all()
                    return Outcome(False, f"{name} failed again after a restart; see {self.run.log(name)}", 1)
                continue
            if code == 0:
                self.stop_all()
                return Outcome(False, f"{name} ({role}) exited before the run finished", 1)
            self.stop_all()
            return Outcome(False, f"{name} ({role}) exited with code {code}; see {self.run.log(name)}",
                           code if 0 < code < 128 else 1)
        orchestrator_done = all(self.running[p.name].popen.poll() == 0 for p in self.plan.by_role("orchestrator"))
        trainers_done = all(self.running[p.name].popen.poll() == 0 for p in self.plan.by_role("trainer"))
        if orchestrator_done and trainers_done:
            stopped = self.run.stop_requested()
            self.stop_all()
            return self._stopped() if stopped else Outcome(True, "run complete", 0)
        return None

    # --- stopping --------------------------------------------------------------------------------

    def _stopped(self) -> Outcome:
        """A requested stop (STOP file, Ctrl-C) is a normal end: the trainer checkpointed after its step."""
        self.progress.poll()
        step = max((s for (role, s), v in self.progress.steps.items() if role == "trainer" and "loss" in v), default=0)
        return Outcome(True, f"stopped at step {step}; resume with `primebuild run --resume {self.run_dir}`", 0)

    def _reap(self, running: Running) -> None:
        # A process that died may leave children behind in its session (vLLM's engine core and workers):
        # end the whole group, so a restart never runs beside an orphan holding memory or a port.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(running.popen.pid, signal.SIGKILL)
        if running.pump:
            running.pump.join(timeout=2)
        running.log.close()

    def stop_all(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for running in self.running.values():
            if running.popen.poll() is None:
                try:
                    os.killpg(running.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for running in self.running.values():
            try:
                running.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(running.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                running.popen.wait()
            if not running.log.closed:
                self._reap(running)


def ports_in_use(plan: Plan) -> list[str]:
    """Ports of the plan another program already holds (another run, say): a health check there would
    answer for the wrong server."""
    busy = []
    for p in plan.processes:
        for purpose, port in sorted(p.ports.items()):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                # like the servers themselves: connections of a finished run in TIME_WAIT don't count
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    busy.append(f"{port} ({p.name} {purpose})")
    return busy


def ports_message(busy: list[str]) -> str:
    return (f"port(s) already in use: {', '.join(busy)}; another run may be going on "
            "(stop it, or pick free ports, e.g. --set inference.port=8100)")


def supervise(plan: Plan, run_dir: Path, *, echo=print, verbosity: int = ATTENTION, live=None) -> Outcome:
    supervisor = Supervisor(plan, run_dir, echo=echo, verbosity=verbosity, live=live)
    try:
        failure = supervisor.start()
        if failure is not None:
            return failure
        return supervisor.watch()
    except BaseException:
        supervisor.stop_all()
        raise
