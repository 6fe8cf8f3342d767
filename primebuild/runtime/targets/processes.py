"""A local child process as a supervisor `Handle`: in its own session, so that its whole group (torchrun
ranks, engine workers) is signalled together and a terminal's Ctrl-C reaches only the supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from primebuild.contracts.run_dir import ProcessRecord, RunDir


class ProcessHandle:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None):
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True,
                                      text=True, bufsize=1, errors="replace")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def lost_contact(self) -> str | None:
        return None  # a child of this very process

    def lost_host(self) -> str | None:
        """The address of the host `lost_contact` names, for a restart to avoid it."""
        return None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def lines(self) -> Iterator[str]:
        assert self.popen.stdout is not None
        yield from self.popen.stdout


def process_identity(pid: int) -> str | None:
    """`<boot id>:<start time in clock ticks>` of a live process on this machine: unique across pid reuse
    and reboots. None when there is no such process (or it has ended)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):  # a zombie has ended: only its parent has not read its status
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot}:{fields[19]}"  # field 22 of the file: the start time


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (in parentheses, which may hold spaces): [0] is the state
    (field 3 of the file), [2] the process group (field 5), [19] the start time (field 22). None: gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def belongs_to(pid: int, run: RunDir) -> bool:
    """Is `pid` a live process of this run? (Its environment names the run folder: a recycled pid is not.)"""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"PRIMEBUILD_RUN_DIR={run.root}".encode() in environ.split(b"\0")


def end_groups(records: list[ProcessRecord], run: RunDir, *, term_seconds: float = 10.0) -> list[str]:
    """SIGTERM, then SIGKILL, the process groups of `records` that still belong to this run (this host)."""
    import time

    alive = [r for r in records if belongs_to(r.pgid, run)]
    for r in alive:
        try:
            os.killpg(r.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + term_seconds
    while time.monotonic() < deadline and any(belongs_to(r.pgid, run) for r in alive):
        time.sleep(0.2)
    for r in alive:
        if belongs_to(r.pgid, run):
            try:
                os.killpg(r.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [r.process for r in alive]


def group_listens_on(pgid: int, port: int) -> bool | None:
    """Does a process of group `pgid` (a process started in a session of its own, with its engine and workers)
    hold the socket listening on TCP `port` here? None when no listener on it is seen in this network
    namespace."""
    listening = _listening_inodes(port)
    if not listening:
        return None
    for pid in group_members(pgid):
        try:
            fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if any(fd.startswith("socket:[") and fd[8:-1] in listening for fd in fds):
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := _stat_fields(entry.name)) and fields[2] == str(pgid)]
