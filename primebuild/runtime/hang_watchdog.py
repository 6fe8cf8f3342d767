"""The hang watchdog: a run whose steps stop advancing ends, with every process's stacks and a culprit.

Silent hangs (a rank stuck in a collective, a server that stopped answering, a weight update that never
completes) are the commonest way an RL run wastes a night. The supervisor asks `HangWatchdog.check()`
on every poll; when no trainer step has finished for longer than the bound

    bound = max(SLOWEST_FACTOR × the slowest step measured so far,
                ESTIMATE_MARGIN × the plan's step-time estimate (estimates section, primebuild/builders/timing.py),
                the floor (`primebuild run --hang-timeout`, default 600 s))

(FIRST_STEP_FACTOR times that before the session's first step, which also loads models and runs the
first evaluation, and after a process exits or restarts until the next step: a restarted server loads
its model again; neither such step counts as a step time), it asks every Python process of the run on this host for its thread stacks
(primebuild/runtime/stacks.py: SIGUSR1 -> stacks/<process>.<pid>.txt), names the stuck process and what it waits
on, writes stacks/hang.txt, and returns the message the supervisor fails the run with. A process that
exits or restarts counts as progress (the final evaluation after the last step has a full bound).

Stacks are taken on the supervisor's host (local target; the Slurm in-job supervisor's node): processes
on other hosts are named as such, their stacks are not fetched.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from primebuild.contracts.plan import Plan
from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.stacks import DUMP_SIGNAL, PROCESS_ENV, RUN_DIR_ENV, main_thread, parse_dump, waits_on

SLOWEST_FACTOR = 5.0
ESTIMATE_MARGIN = 4.0
FIRST_STEP_FACTOR = 3.0
DUMP_WAIT_SECONDS = 3.0  # how long a process may take to write its stacks


def estimated_step_seconds(plan: Plan) -> float:
    """The plan's own step-time estimate (0 when it made none): synchronous worst case where modelled."""
    profile, step, sync = plan.estimates.profile, plan.estimates.step, plan.estimates.weight_sync
    if profile is not None and profile.sync_step_seconds:
        return max(profile.sync_step_seconds, profile.async_step_seconds)
    return (step.step_seconds if step else 0.0) + (sync.seconds if sync else 0.0)


@dataclass
class PidState:
    process: str
    pid: int
    state: str  # /proc/PID/stat: R running, S sleeping, D disk wait, T stopped, Z zombie
    catches_dump: bool
    command: str


@dataclass
class HangWatchdog:
    plan: Plan
    run: RunDir
    floor_s: float
    clock: Callable[[], float] = time.monotonic
    estimate_s: float = 0.0
    last_step: int = -1  # -1: not read yet (a resumed run starts after the steps of earlier sessions)
    last_trained: int = -1  # steps trained so far, retrained ones included (a restarted trainer redoes some)
    first_step: int = 0  # the step this session started after
    last_progress: float = 0.0
    slowest_s: float = 0.0
    _signature: tuple = ()
    _restarted: bool = False  # a process exited or restarted since the last step
    culprit: str = ""
    culprit_process: str = ""  # the plan process named first (failure.json names it)
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.estimate_s = estimated_step_seconds(self.plan)
        self.last_progress = self.clock()

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def bound(self) -> float:
        bound = max(SLOWEST_FACTOR * self.slowest_s, ESTIMATE_MARGIN * self.estimate_s, self.floor_s)
        starting = self.last_step <= self.first_step or self._restarted
        return FIRST_STEP_FACTOR * bound if starting else bound

    def check(self, newest_step: int, processes: tuple, trained: int | None = None) -> str | None:
        """None while the run progresses; else the message to end it with (stacks already dumped).

        `newest_step`: the newest step the trainer finished; `processes`: anything that changes when a
        process exits or restarts (e.g. (name, restarts, alive) per process); `trained`: how many steps
        were trained so far, a step trained again after a trainer restart counted again (default:
        `newest_step`), so that retraining the steps after a checkpoint is progress too."""
        if not self.enabled:
            return None
        now = self.clock()
        trained = newest_step if trained is None else trained
        if self.last_step < 0:
            self.first_step = self.last_step = newest_step
            self.last_trained = trained
        if trained > self.last_trained:
            # the session's first step, and the first after a restart (a model loaded again), paid for start-up
            if self.last_step > self.first_step and not self._restarted:
                self.slowest_s = max(self.slowest_s, (now - self.last_progress) / (trained - self.last_trained))
            self.last_step, self.last_trained = max(self.last_step, newest_step), trained
            self.last_progress, self._restarted = now, False
        if processes != self._signature:
            self._restarted = bool(self._signature)  # the first look is no change
            self._signature, self.last_progress = processes, now
        idle, bound = now - self.last_progress, self.bound()
        if idle <= bound:
            return None
        what = f"step {self.last_step + 1}"
        culprit = self.diagnose()
        return (f"hang: {what} made no progress for {idle:.0f} s (bound {bound:.0f} s: max of {SLOWEST_FACTOR:g}× "
                f"the slowest step {self.slowest_s:.1f} s, {ESTIMATE_MARGIN:g}× the plan's estimate "
                f"{self.estimate_s:.1f} s, floor {self.floor_s:.0f} s); {culprit}; stacks in {self.run.stacks}")

    # --- stacks ----------------------------------------------------------------------------------

    def diagnose(self) -> str:
        """Dump every local Python process's stacks, write stacks/hang.txt, and name the stuck process.

        Who is named first: a stopped process, then one that did not answer, then one waiting in a
        collective (its peer is the one that stopped coming), then one busy in its own code (a reward that
        never returns), then one waiting on its event loop or a call, then one waiting on another's output
        (a trainer on its batch), and last a server idle in its event loop (nobody asks it anything)."""
        pids = run_processes(self.run)
        roles = {spec.name: spec.role for spec in self.plan.processes}
        ranked: dict[int, list[tuple[str, str]]] = {rank: [] for rank in range(7)}
        self.lines = []
        for p in pids:
            label = f"{p.process} (pid {p.pid})"
            if p.state in ("T", "t"):
                ranked[0].append((p.process, f"{label} is stopped (state {p.state}): it cannot run, so what waits "
                                             "on it never advances"))
                self.lines.append(f"{label}: stopped (state {p.state}); a stopped process cannot write its stacks")
                continue
            if not p.catches_dump:
                self.lines.append(f"{label}: {p.command[:80]!r} takes no stack requests (not a primebuild process)")
                continue
            threads = parse_dump(request_stacks(self.run.stack_file(p.process, p.pid), p.pid))
            if not threads:
                ranked[1].append((p.process, f"{label} did not answer the stack request within "
                                             f"{DUMP_WAIT_SECONDS:g} s (state {p.state})"))
                self.lines.append(f"{label}: no answer (state {p.state})")
                continue
            top = main_thread(threads)
            waits = [w for t in [top, *threads] if t is not None and (w := waits_on(t))]  # the main thread first
            where = (f"{top.frames[0].function} at {Path(top.frames[0].file).name}:{top.frames[0].line}"
                     if top and top.frames else "no Python frame")
            summary = f"waits on {waits[0]}" if waits else f"main thread in {where}"
            self.lines.append(f"{label}: {summary}; {len(threads)} thread(s); main thread innermost: {where}")
            role = roles.get(p.process, "inference" if p.process.startswith("inference-") else "")  # `scale`'s too
            ranked[_rank(role, waits[0] if waits else None)].append((p.process, f"{label} {summary}"))
        remote = sorted({p.name for p in self.plan.processes} - {p.process for p in pids})
        if remote:
            self.lines.append(f"not on this host (no stacks taken): {', '.join(remote)}")
        self.run.stacks.mkdir(parents=True, exist_ok=True)
        (self.run.stacks / "hang.txt").write_text("\n".join(self.lines) + "\n")
        found = [entry for rank in sorted(ranked) for entry in ranked[rank]]
        self.culprit_process, self.culprit = found[0] if found else ("", "no process of the run answered on this host")
        return self.culprit


def _rank(role: str, wait: str | None) -> int:
    """diagnose()'s order for a process that answered with its stacks (0 and 1 are taken before)."""
    if wait is None:
        return 3  # running code of its own
    if wait.startswith("a collective"):
        return 2
    if wait.startswith("its event loop") and role in ("inference", "prefill", "decode", "router", "teacher"):
        return 6  # a server with nothing to do
    if wait.startswith(("a rollout batch", "a weight update")):
        return 5  # waits on another process's output: that one is the story
    return 4


def end_leftovers(run: RunDir, *, stopped_only: bool = False) -> list[int]:
    """SIGKILL what is left of the run on this host once it was told to stop: a stopped (SIGSTOP, state T)
    torchrun rank holds its SIGTERM pending forever, and lives in a session of its own that the
    supervisor's group kill does not reach. `stopped_only`: only the stopped ones, which could neither
    checkpoint nor exit on SIGTERM, so waiting for them would only add the SIGTERM grace to the stop."""
    left = [p.pid for p in run_processes(run) if p.state == "T" or not stopped_only]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def end_processes(run: RunDir, names: set[str]) -> list[int]:
    """SIGKILL every process on this host of these plan processes (their children too: a trainer's torchrun
    ranks, in sessions of their own, which a kill of the process group does not reach)."""
    left = [p.pid for p in run_processes(run) if p.process in names]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DUMP_WAIT_SECONDS  # gone (memory, ports) before a restart starts anew
    while time.monotonic() < deadline and any(p.process in names for p in run_processes(run)):
        time.sleep(0.05)
    return left


def run_processes(run: RunDir) -> list[PidState]:
    """Every live process of this run on this host, with the plan process it belongs to (its environment)."""
    out = []
    marker = f"{RUN_DIR_ENV}={run.root}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if marker not in environ:
                continue
            process = next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(PROCESS_ENV.encode() + b"=")),
                           None)
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if process is None:
            continue
        state = stat[stat.rindex(")") + 2]  # the command name in parentheses may hold spaces
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        out.append(PidState(process, int(entry.name), state, bool(caught >> (DUMP_SIGNAL - 1) & 1), command))
    return sorted(out, key=lambda p: (p.process, p.pid))


def request_stacks(path: Path, pid: int) -> str:
    """Signal `pid` to dump its stacks into `path`; return what it wrote (empty when it did not answer)."""
    before = path.stat().st_size if path.is_file() else 0
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + DUMP_WAIT_SECONDS
    size, settled = before, 0
    while time.monotonic() < deadline and settled < 3:  # written, and no longer growing
        time.sleep(0.1)
        now = path.stat().st_size if path.is_file() else 0
        settled = settled + 1 if now == size and now > before else 0
        size = now
    if size <= before:
        return ""
    with open(path, errors="replace") as f:
        f.seek(before)
        return f.read()
