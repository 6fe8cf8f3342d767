"""The supervisor: start a plan's processes through a launcher and watch them (every target but Kubernetes).

The same engine runs the local target (processes on this machine), the ssh target (processes on the
inventory's hosts, started with fabric) and the Slurm target (inside the job, each process an `srun`
step of its het-job component): only the launcher differs (primebuild/runtime/targets/).

- Processes start in the plan's start order; each order waits until the previous ones are healthy
  (an HTTP health check at the address the rendezvous gives, or simply alive).
- Every process is `primebuild worker --plan … --process NAME`; its output goes to logs/NAME.log. The
  terminal gets one progress line per step (from metrics.jsonl) and, prefixed with the process's name,
  the lines that ask for attention (warnings, errors, tracebacks); `verbose` adds every line (access
  logs, per-request lines), `quiet` keeps the progress alone.
- A server that is up is probed all along (primebuild/runtime/liveness.py): one whose process lives but whose
  engine died (its /health answers 5xx) counts as dead, as does a server process that exits, even with 0.
- A process that dies is restarted when its restart policy says so. The trainer restarts as a group
  (every trainer process and rank ends, then all start again): it resumes from its newest checkpoint and
  retrains the steps after it from the rollout batches on disk, while the servers keep their model and
  the orchestrator its rollouts (it waits within its off-policy bound). A trainer that printed an
  `error:` of its own (bad input, a non-finite step) would fail the same way again: not restarted.
  Otherwise the run fails fast:
  failure.json names the process, its exit status and its last log lines; a STOP file lets the trainer
  checkpoint the step it finished (so `--resume` loses nothing) for at most STOP_GRACE_SECONDS; then
  every process gets SIGTERM and, TERM_SECONDS later, SIGKILL. The whole run is down well within 30 s.
- The run ends when the orchestrator exits 0 and the trainer has finished.
- No step for longer than the hang bound (primebuild/runtime/hang_watchdog.py): the stuck process is named and
  the run fails as above, a stopped (SIGSTOP) process SIGKILLed at once since it could not take SIGTERM.
  When the stuck one is the trainer, with its next rollout batch on disk, and its policy allows, only the
  trainer group is ended and restarted.
- No step for STALL_SECONDS: the terminal says so (and again every STALL_SECONDS), with the processes'
  last attention lines in their logs, so a run never sits silent.
- `primebuild scale RUN --inference +1 / -1` adds or retires an inference replica while the run goes
  on (primebuild/runtime/elastic.py answers its requests between health checks).
- Ctrl-C (or a STOP file in the run folder) asks the trainer to checkpoint and the orchestrator to stop,
  waits a bounded time, then stops everything; `primebuild run --resume RUN_DIR` continues from there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from primebuild.builders.store import hold_entries
from primebuild.contracts.inference import ADMIN_TOKEN_ENV
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.run_dir import FailureRecord, RunDir, write_json_atomic
from primebuild.runtime.elastic import ElasticInference
from primebuild.runtime.hang_watchdog import HangWatchdog, end_leftovers, end_processes
from primebuild.runtime.launcher import Handle, Launcher
from primebuild.runtime.liveness import START_MARKER, LivenessProbe, first_error_line
from primebuild.runtime.progress import Progress
from primebuild.runtime.resume import trainer_restart

GRACE_SECONDS = 60  # a requested stop: how long the trainer may take to finish its step and checkpoint
STOP_GRACE_SECONDS = 8.0  # a failure: how long the survivors may take to checkpoint before SIGTERM
TERM_SECONDS = 10.0  # SIGTERM -> SIGKILL
LOG_TAIL_LINES = 30
STALL_SECONDS = 300.0  # no new metrics for this long: the terminal says so (again every STALL_SECONDS)
QUIET, ATTENTION, VERBOSE = 0, 1, 2
# What a person must see on the terminal: log records at WARNING and above (every process logs with its
# level), tracebacks and `error:` lines. torch/transformers chatter, tqdm bars and access logs stay in logs/.
_ATTENTION = {"warnings": re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^Traceback|^error:|^\w+(Error|Exception): "),
              "errors": re.compile(r"\b(ERROR|CRITICAL)\b|^Traceback|^error:")}


@dataclass
class Running:
    spec: ProcessSpec
    handle: Handle
    log: TextIO
    restarts: int = 0
    pump: threading.Thread | None = None
    probe: LivenessProbe | None = None  # once an HTTP server was healthy
    other_listener_said: bool = False  # its port answered for another program (said once)


@dataclass
class Outcome:
    ok: bool
    message: str
    exit_code: int


def describe_exit(code: int | None) -> tuple[str, str | None]:
    """'exited with code 3' / 'was killed by SIGKILL', and the signal's name (Popen: -N; a shell: 128+N)."""
    if code is None:
        return "did not exit", None
    number = -code if code < 0 else code - 128 if 128 < code < 160 else 0
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name} (exit status {code})", name
    return f"exited with code {code}", None


class Supervisor:
    def __init__(self, plan: Plan, run_dir: Path, launcher: Launcher, *, echo=print, verbosity: int = ATTENTION,
                 live=None):
        self.plan = plan
        self.run = RunDir(run_dir)
        self.run_dir = run_dir
        self.launcher = launcher
        self.echo = echo
        self.verbosity = verbosity
        self.stopping = False
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, Running] = {}
        # The admin token lives only in this process tree's environment: never in a file or a log.
        self.admin_token = secrets.token_urlsafe(24)
        self.progress = Progress(self.run.metrics, echo, live)
        self._progress_seen = (-1, time.monotonic())  # (metrics offset, when it last moved)
        rendezvous = self.run.read_rendezvous()
        self.hosts = rendezvous.hosts
        # shared locks on the store entries the processes load (and a replica `scale` adds will): `store gc`
        # keeps them until this session ends
        self._store_locks = hold_entries(p for p in (rendezvous.model_path, rendezvous.teacher_model_path) if p)
        self.hang = HangWatchdog(plan, self.run, self.run.read_supervision().hang_floor_s)
        self.elastic = ElasticInference(self, getattr(launcher, "kind", "remote"))

    # --- starting --------------------------------------------------------------------------------

    def _spawn(self, spec: ProcessSpec, restarts: int = 0) -> Running:
        name = spec.name
        log = open(self.run.log(name), "a", buffering=1)  # noqa: SIM115 (closed in _reap)
        if log.tell() and not _ends_with_newline(self.run.log(name)):  # the last session's output was cut
            log.write("\n")
        log.write(f"{START_MARKER}{time.strftime('%Y-%m-%dT%H:%M:%S')} (restart {restarts}) ---\n")
        env = {ADMIN_TOKEN_ENV: self.admin_token, "PYTHONUNBUFFERED": "1"}
        scaled_plan = self.elastic.plan_path_of(name)  # a replica `scale` added: not in plan.json
        handle = self.launcher.start(spec, env, plan_path=scaled_plan) if scaled_plan else self.launcher.start(spec, env)
        running = Running(spec, handle, log, restarts)
        running.pump = threading.Thread(target=self._pump, args=(name, handle, log, _ATTENTION[spec.terminal]),
                                        daemon=True)
        running.pump.start()
        return running

    def _pump(self, name: str, handle: Handle, log: TextIO, attention: re.Pattern) -> None:
        writable = True
        for line in handle.lines():  # drained to the end whatever happens: a full pipe would block the process
            if writable:
                try:
                    log.write(line)
                except (OSError, ValueError) as err:  # a full disk (or the log closed by a teardown)
                    writable = False
                    if not isinstance(err, ValueError):
                        self.echo(f"warning: cannot write {self.run.log(name)}: {err.strerror}; its lines "
                                  "reach this terminal only")
            if not writable and attention.search(line):
                self.echo(f"[{name}] {line.rstrip()}")
                continue
            if self.stopping and self.verbosity != VERBOSE:
                continue  # what processes say while being torn down is in their logs
            if self.verbosity == VERBOSE or (self.verbosity == ATTENTION and attention.search(line)):
                self.echo(f"[{name}] {line.rstrip()}")

    def health_url(self, spec: ProcessSpec) -> str:
        url = spec.health.url or ""
        for node, host in enumerate(self.hosts):
            url = url.replace("{host:" + str(node) + "}", host)
        return url

    def _healthy(self, running: Running, deadline: float, give_up=None) -> bool:
        """Until `running` answers its health check (True), dies or `deadline` passes (False); also False
        as soon as `give_up()` is true."""
        health = running.spec.health
        url = self.health_url(running.spec)
        while time.monotonic() < deadline:
            if running.handle.poll() is not None or (give_up is not None and give_up()):
                return False
            if health.kind == "process":
                return True
            try:
                with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (the run's own servers)
                    answered = response.status == 200
            except OSError:
                answered = False
            if answered and self._answered_by(running, url):
                running.probe = LivenessProbe(running.spec.name, url)
                return True
            time.sleep(0.2)
        return False

    def _answered_by(self, running: Running, url: str) -> bool:
        """Was the health answer `running`'s own? Where the handle can tell (a process on this host), the port
        must be held by it: another run's server on the same port answered 200 for it, and this run then
        sampled from the other run's model."""
        listens_on = getattr(running.handle, "listens_on", None)
        port = urllib.parse.urlsplit(url).port
        if listens_on is None or port is None or listens_on(port) is not False:
            return True
        if not running.other_listener_said:
            running.other_listener_said = True
            self.echo(f"warning: {running.spec.name}: port {port} answers, but another program holds it (another "
                      "run?); waiting for this process's own server")
        return False

    def start(self) -> Outcome | None:
        self.elastic.write_pool()  # before the orchestrator starts: never a list left by an earlier session
        orders = sorted({p.start_order for p in self.plan.processes})
        for order in orders:
            group = [p for p in self.plan.processes if p.start_order == order]
            for spec in group:
                self.running[spec.name] = self._spawn(spec)
            for spec in group:
                running = self.running[spec.name]
                if not self._healthy(running, time.monotonic() + spec.health.timeout_s):
                    code = running.handle.poll()
                    what = describe_exit(code)[0] if code is not None else "timed out"
                    if code is not None and running.pump:
                        running.pump.join(timeout=2)  # its last lines into the log, for the cause
                    if cause := first_error_line(self.run.log(spec.name)):
                        what += f": {cause}"
                    return self._fail(running, code, f"{spec.name} did not become healthy ({what}); "
                                      f"see {self.run.log(spec.name)}", 1)
        return None

    # --- watching --------------------------------------------------------------------------------

    def watch(self) -> Outcome:
        with _terminate_raises():
            try:
                return self._watch()
            except Terminated:  # `primebuild stop --now`, a scheduler's or a person's kill: end now, and say so
                self.stop_all()
                self.progress.poll()
                step = self.progress.newest_trained_step()
                return Outcome(False, f"ended by SIGTERM at step {step}, without a checkpoint of its own: resume "
                               f"from the newest checkpoint with `primebuild run --resume {self.run_dir}`", 143)

    def _watch(self) -> Outcome:
        interrupted = False
        stop_file = self.run.stop_file
        stop_deadline = None
        self.hang.last_progress = time.monotonic()  # start-up (health checks) is not a step
        try:
            while True:
                try:
                    self.progress.poll()
                    self._notice_stall()
                    outcome = self._check() or self._check_hang()
                    if outcome is not None:
                        return outcome
                    self.elastic.poll()
                    if stop_deadline is None and stop_file.exists():
                        stop_deadline = time.monotonic() + GRACE_SECONDS  # `primebuild stop` from elsewhere
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

    def _done(self) -> bool:
        """The orchestrator and the trainers ended well: the servers have nothing left to serve."""
        return all(self.running[p.name].handle.poll() == 0
                   for p in [*self.plan.by_role("orchestrator"), *self.plan.by_role("trainer")])

    def _ending(self) -> bool:
        """A stop was asked for, or the run is done: a server that goes now is not restarted (its start
        would hold this loop for minutes while the run waits to end; measured in CI: it never ended)."""
        return self.run.stop_requested() or self._done()

    def _check(self) -> Outcome | None:
        if self._done():  # first: a server that fails as the run ends is no failure of the run
            stopped = self.run.stop_requested()
            self.stop_all()
            return self._stopped() if stopped else Outcome(True, "run complete", 0)
        for name, running in list(self.running.items()):
            code = running.handle.poll()
            role = running.spec.role
            if code is None:
                if running.probe is None or running.probe.cause is None:
                    continue
                # alive, but its engine is gone: as dead as an exited server (its restart kills the group)
                why = f"is up but dead: {running.probe.cause}"
            elif code == 0 and role in ("orchestrator", "trainer"):
                continue
            else:  # a server that exits, even with 0, failed: it has no end of its own
                why = running.handle.lost_contact() or describe_exit(code)[0]
            why = self._with_first_error(name, why)
            policy = running.spec.restart
            if role == "trainer" and self._may_restart_trainers(running):
                self.echo(f"{name} {why}: restarting the trainer ({running.restarts + 1}/{policy.max_restarts})")
                failure = self._restart_trainers()
                if failure is not None:
                    return failure
                continue
            if role not in ("trainer", "orchestrator") and self.run.stop_requested():
                if not running.log.closed:  # gone during the stop: ended with its children, not restarted
                    self._reap(running)
                continue
            if role != "trainer" and policy.policy == "on-failure" and running.restarts < policy.max_restarts \
                    and running.handle.lost_contact() is None:  # no restart on a host nothing reaches
                failure = self._restart_server(running, why)
                if failure is not None:
                    return failure
                continue
            return self._fail(running, code, f"{name} ({role}) {why}; see {self.run.log(name)}",
                              code if code is not None and 0 < code < 128 else 1)
        return None

    def _with_first_error(self, name: str, why: str) -> str:
        """`why` a process failed, with the first error line of its log when it printed one."""
        cause = first_error_line(self.run.log(name))
        return f"{why} ({cause})" if cause else why

    def _restart_server(self, running: Running, why: str) -> Outcome | None:
        """Start a failed server again, and again while it dies before it is healthy, up to its policy's
        max_restarts (each start counts one); a start that hangs until its health timeout ends the run."""
        name, policy = running.spec.name, running.spec.restart
        while True:
            self.echo(f"{name} {why}: restarting ({running.restarts + 1}/{policy.max_restarts})")
            self._reap(running)
            running = self.running[name] = self._spawn(running.spec, running.restarts + 1)
            if self._healthy(running, time.monotonic() + running.spec.health.timeout_s, give_up=self._ending):
                return None
            if self._ending():  # a stop (or the run's end) came while it started: that ends it
                return None
            code = running.handle.poll()
            if code is None or running.restarts >= policy.max_restarts or running.handle.lost_contact():
                return self._fail(running, code, f"{name} failed again after a restart; see {self.run.log(name)}", 1)
            why = self._with_first_error(name, describe_exit(code)[0]) + " while it started"

    def _may_restart_trainers(self, running: Running) -> bool:
        """A trainer failure the trainer-only restart covers: its policy has restarts left, no stop was
        asked for, every trainer host answers, and it did not report an error of its own (config_main's `error:`
        lines: bad input, a non-finite step), which the same checkpoint and batches would repeat."""
        policy = running.spec.restart
        reachable = all(self.running[p.name].handle.lost_contact() is None for p in self.plan.by_role("trainer"))
        return (policy.policy == "on-failure" and running.restarts < policy.max_restarts
                and not self.run.stop_requested() and reachable
                and not _reported_an_error(self.run.log(running.spec.name)))

    def _restart_trainers(self) -> Outcome | None:
        """End every trainer process (and ranks in sessions of their own), then start the group again from
        its newest checkpoint; the servers and the orchestrator run on."""
        trainers = [self.running[p.name] for p in self.plan.by_role("trainer")]
        for running in trainers:
            self._reap(running)
        end_processes(self.run, {r.spec.name for r in trainers})  # torchrun's ranks live in sessions of their own
        after = trainer_restart(self.run, self.echo)
        record = self.run.trainer_restarts
        with open(record, "a") as f:  # when, and from which checkpoint: for whoever reads the run later
            f.write(json.dumps({"time": time.time(), "resume_after": after,
                                "restart": trainers[0].restarts + 1}) + "\n")
        self.echo(f"trainer: starting again after the checkpoint of step {after}" if after else
                  "trainer: starting again from step 1 (no checkpoint yet)")
        for running in trainers:
            self.running[running.spec.name] = self._spawn(running.spec, running.restarts + 1)
        for running in trainers:
            replacement = self.running[running.spec.name]
            if not self._healthy(replacement, time.monotonic() + running.spec.health.timeout_s):
                return self._fail(replacement, replacement.handle.poll(), f"{running.spec.name} failed again "
                                  f"after a restart; see {self.run.log(running.spec.name)}", 1)
        return None

    def _check_hang(self) -> Outcome | None:
        """No step for longer than the hang bound: end the run naming the stuck process (hang_watchdog.py);
        a stuck trainer whose next batch is on disk is restarted instead, where its policy allows."""
        states = tuple((n, r.restarts, r.handle.poll()) for n, r in sorted(self.running.items()))
        message = self.hang.check(self.progress.newest_trained_step(), states, self.progress.trained)
        if message is None:
            return None
        stuck = self.running.get(self.hang.culprit_process) or self.running[self.plan.by_role("trainer")[0].name]
        # the batch of the step it did not finish is there: the trainer, not what feeds it, is stuck
        fed = self.run.rollout(self.progress.newest_trained_step() + 1).exists()
        if stuck.spec.role == "trainer" and fed and self._may_restart_trainers(stuck):
            self.echo(f"warning: {message}: restarting the trainer "
                      f"({stuck.restarts + 1}/{stuck.spec.restart.max_restarts})")
            return self._restart_trainers()
        end_leftovers(self.run, stopped_only=True)  # their stacks are dumped; the others may still checkpoint
        outcome = self._fail(stuck, None, message, 1)
        end_leftovers(self.run)  # a frozen process ignores SIGTERM, and a torchrun rank is not in its group
        return outcome

    def _notice_stall(self) -> None:
        offset, since = self._progress_seen
        now = time.monotonic()
        if self.progress.offset != offset:
            self._progress_seen = (self.progress.offset, now)
        elif now - since > STALL_SECONDS:
            self._progress_seen = (offset, now)
            alive = ", ".join(n for n, r in self.running.items() if r.handle.poll() is None)
            self.echo(f"warning: no new metrics for {STALL_SECONDS:.0f} s (last trained step "
                      f"{max(self.progress.printed, default=0)}); running: {alive}; see {self.run.logs}/")

    # --- failing and stopping --------------------------------------------------------------------

    def _fail(self, running: Running, code: int | None, message: str, exit_code: int) -> Outcome:
        """Fail fast: name the process in failure.json, let the survivors checkpoint briefly, stop all."""
        if running.pump:
            running.pump.join(timeout=2)  # its last lines into the log first
        with contextlib.suppress(OSError):  # a full disk: the tail is what made it to the file
            running.log.flush()
        log = self.run.log(running.spec.name)
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.is_file() else []
        record = FailureRecord(process=running.spec.name, role=running.spec.role, exit_code=code,
                               signal=describe_exit(code)[1], message=message, log=str(log), log_tail=tail,
                               lost_host=running.handle.lost_host())
        try:
            write_json_atomic(self.run.failure, record.model_dump(mode="json"))
            self.run.stop_file.touch()  # the trainer saves the step it finished, the orchestrator stops
        except OSError as err:  # a full disk: the others are ended below all the same
            self.echo(f"warning: cannot write {self.run.failure.name} in {self.run_dir}: {err.strerror}")
        self.echo(f"error: {message}; stopping every other process")
        # a trainer rank that lost contact takes the trainer's collectives with it: no checkpoint to wait for
        lost_trainer = running.spec.role == "trainer" and running.handle.lost_contact() is not None
        deadline = time.monotonic() + (0 if lost_trainer else STOP_GRACE_SECONDS)
        survivors = [r for r in self.running.values() if r.spec.role in ("trainer", "orchestrator")]
        while time.monotonic() < deadline and any(r.handle.poll() is None for r in survivors):
            time.sleep(0.2)
        self.stop_all()
        return Outcome(False, message, exit_code)

    def _stopped(self) -> Outcome:
        """A requested stop (STOP file, Ctrl-C) is a normal end: the trainer checkpointed after its step."""
        self.progress.poll()
        step = self.progress.newest_trained_step()
        return Outcome(True, f"stopped at step {step}; resume with `primebuild run --resume {self.run_dir}`", 0)

    def _reap(self, running: Running) -> None:
        # A process that died may leave children behind in its process group (vLLM's engine core and
        # workers): end the whole group, so a restart never runs beside an orphan holding memory or a port.
        if running.probe:
            running.probe.stop()
        running.handle.kill()
        if running.pump:
            running.pump.join(timeout=2)
        with contextlib.suppress(OSError):  # its last buffered lines on a full disk: the process is gone anyway
            running.log.close()

    def stop_all(self, timeout: float = TERM_SECONDS) -> None:
        self.stopping = True
        for running in self.running.values():
            if running.probe:
                running.probe.stop()  # a server going down now is no news
        for running in self.running.values():
            if running.handle.poll() is None:
                running.handle.terminate()
        deadline = time.monotonic() + timeout
        for running in self.running.values():
            if running.handle.wait(max(0.1, deadline - time.monotonic())) is None:
                running.handle.kill()
                running.handle.wait(TERM_SECONDS)
            if not running.log.closed:
                self._reap(running)
        for fd in self._store_locks:  # what read the store entries is gone: `store gc` may take them now
            os.close(fd)
        self._store_locks = []


def ports_in_use(plan: Plan) -> list[str]:
    """Ports of the plan another program already holds on this machine (another run, say): a health
    check there would answer for the wrong server. (Local target: every port is on this machine.)"""
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


class Terminated(BaseException):
    """SIGTERM reached the supervising process (raised in its main thread by `_terminate_raises`)."""


@contextmanager
def _terminate_raises():
    """While watching, SIGTERM raises Terminated in the main thread (Python's default would end the process
    at once: no outcome recorded, no message). A handler of its own stays (the Slurm job's supervisor: there
    SIGTERM asks for a checkpoint first), and so does SIGTERM outside the main thread."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def supervise(plan: Plan, run_dir: Path, launcher: Launcher, *, echo=print, verbosity: int = ATTENTION,
              live=None) -> Outcome:
    supervisor = Supervisor(plan, run_dir, launcher, echo=echo, verbosity=verbosity, live=live)
    try:
        failure = supervisor.start()
        if failure is not None:
            return failure
        return supervisor.watch()
    except BaseException:
        supervisor.stop_all()
        raise


def _reported_an_error(log: Path) -> bool:
    """Did the process print an `error: …` line of its own since it last started (config_main's report of
    a UserError or a handled failure; under torchrun the line comes prefixed with the rank)?"""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 500_000))  # the end of a long run's log is enough
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    since = text[text.rfind(START_MARKER):] if START_MARKER in text else text
    return any(_OWN_ERROR.search(line) for line in since.splitlines())


_OWN_ERROR = re.compile(r"^(\[[^]]*\]:?\s*)?error: ")


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
