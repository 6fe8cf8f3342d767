"""The ssh target: plan node N on inventory host `target.hosts[N]`, supervised by `primebuild run` here.

Connections are fabric's (so ~/.ssh/config, or the file PRIMEBUILD_SSH_CONFIG names, gives users, ports,
IdentityFile and UserKnownHostsFile), with one change: fabric accepts unknown host keys by default,
and here a host whose key is not in known_hosts (UserKnownHostsFile, ~/.ssh/known_hosts) is refused.
Each process runs in one ssh session (primebuild/builders/render/ssh.py has the command); its output streams back
into logs/NAME.log; its exit status is the session's. Stopping a process is `kill -TERM -- -PGID` on its
host, the process group the worker recorded in pids/NAME.json (the run folder is on a filesystem every
host sees), checked to still belong to this run.

A host can drop off the network without closing anything. Each connection sends an SSH keepalive every
KEEPALIVE_S and its socket gives up on data the host does not acknowledge for LOST_AFTER_S
(TCP_USER_TIMEOUT), so a cut link ends the connection within about KEEPALIVE_S + LOST_AFTER_S: each of
that host's processes then reads as exited with 255 (what ssh(1) returns on a lost connection) and
`lost_contact()` names the host. It is not signalled any more (nothing gets through); its processes
end by themselves once its sshd drops their session (the worker dies with its session: primebuild/runtime/worker.py).
"""

from __future__ import annotations

import os
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from primebuild.builders.render.ssh import host_of, remote_command, remote_python, shell_path, signal_command
from primebuild.contracts.plan import Plan, ProcessSpec, read_plan
from primebuild.contracts.run_dir import LaunchRecord, RunDir, single_host_or
from primebuild.errors import UserError
from primebuild.runtime.targets.base import Echo, Target
from primebuild.runtime.targets.local import SupervisedHere, write_rendezvous

CONFIG_ENV = "PRIMEBUILD_SSH_CONFIG"
CONNECT_TIMEOUT_S = 15
KEEPALIVE_S = 2
LOST_AFTER_S = 10
LOST_EXIT = 255  # ssh(1)'s exit status when the connection is lost
RECORD_WAIT_S = 10.0  # how long a just-started worker may take to record its process group


def connect(plan: Plan, host: str):
    """A fabric Connection to `host` that verifies the host key against known_hosts."""
    import fabric
    from paramiko import RejectPolicy

    config = fabric.Config(runtime_ssh_path=os.environ.get(CONFIG_ENV) or None)
    target = plan.target
    kwargs = {"connect_timeout": CONNECT_TIMEOUT_S, "config": config, "port": target.port}
    if target.user:
        kwargs["user"] = target.user
    conn = fabric.Connection(host, **kwargs)
    client = conn.client
    client.set_missing_host_key_policy(RejectPolicy())
    files = conn.ssh_config.get("userknownhostsfile") or "~/.ssh/known_hosts"
    for path in (files.split() if isinstance(files, str) else files):
        expanded = Path(os.path.expanduser(path))
        if expanded.is_file():
            client.load_host_keys(str(expanded))
    return conn


def _open(conn):
    from paramiko.ssh_exception import SSHException

    try:
        conn.open()
        transport = conn.client.get_transport()
        transport.set_keepalive(KEEPALIVE_S)  # traffic that a dead link leaves unacknowledged
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LOST_AFTER_S * 1000)
    except SSHException as err:
        raise UserError(f"ssh {conn.user}@{conn.host}:{conn.port}: {err}",
                        hint="its host key must be in known_hosts (ssh-keyscan, then check it); primebuild "
                             "never accepts an unknown host key") from None
    except OSError as err:
        raise UserError(f"ssh {conn.user}@{conn.host}:{conn.port}: {err}") from None
    return conn


class SshHandle:
    """One process in one ssh session."""

    def __init__(self, launcher: SshLauncher, spec: ProcessSpec, stdin: str):
        self.launcher, self.spec = launcher, spec
        conn = launcher.connection(host_of(launcher.plan, spec))
        self.channel = conn.client.get_transport().open_session()
        self.channel.set_combine_stderr(True)
        self.channel.exec_command(remote_command(launcher.plan, str(launcher.run.root), spec))
        self.channel.sendall(stdin.encode())
        self.started = time.monotonic()

    def poll(self) -> int | None:
        if self.lost_contact() is not None:
            return LOST_EXIT
        return self.channel.recv_exit_status() if self.channel.exit_status_ready() else None

    def lost_contact(self) -> str | None:
        """Why the process's host cannot be reached any more, or None: its connection died before the
        process's exit status came back."""
        host = host_of(self.launcher.plan, self.spec)
        if self.channel.exit_status_ready() and self.channel.exit_status != -1:
            return None
        if not self.launcher.lost(host):
            return None
        return f"lost contact with host {host} (its ssh connection went unanswered for {LOST_AFTER_S} s)"

    def lost_host(self) -> str | None:
        return host_of(self.launcher.plan, self.spec) if self.lost_contact() else None

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.1)
        return self.poll()

    def _signal(self, sig: str) -> None:
        if self.launcher.lost(host_of(self.launcher.plan, self.spec)):
            return  # nothing reaches it; its sshd ends the session, and the worker with it
        record = self.launcher.record_of(self.spec.name, since=self.started)
        if record is None:
            self.channel.close()
            return
        self.launcher.signal_group(self.spec, record.pgid, sig)

    def terminate(self) -> None:
        self._signal("TERM")

    def kill(self) -> None:
        self._signal("KILL")
        self.channel.close()

    def lines(self) -> Iterator[str]:
        stream = self.channel.makefile("r")
        for raw in stream:
            yield raw if isinstance(raw, str) else raw.decode(errors="replace")


class SshLauncher:
    def __init__(self, plan: Plan, run: RunDir):
        self.plan, self.run = plan, run
        self.connections: dict[str, object] = {}
        self.lock = threading.Lock()

    def connection(self, host: str):
        with self.lock:
            if host not in self.connections:
                self.connections[host] = _open(connect(self.plan, host))
            return self.connections[host]

    def start(self, spec: ProcessSpec, env: dict[str, str]) -> SshHandle:
        passed = dict(env)
        passed.update({name: os.environ[name] for name in spec.secrets if name in os.environ})
        self.run.process_record(spec.name).unlink(missing_ok=True)  # a restart records anew
        stdin = "".join(f"{k}={v}\n" for k, v in passed.items() if "\n" not in v) + "\n"  # provision refused those
        return SshHandle(self, spec, stdin)

    def lost(self, host: str) -> bool:
        """Whether the connection to `host` died (a process's exit status never arrives over it)."""
        with self.lock:
            conn = self.connections.get(host)
        transport = conn.client.get_transport() if conn is not None else None
        return transport is not None and not transport.is_active()

    def record_of(self, name: str, since: float):
        deadline = since + RECORD_WAIT_S
        while True:
            records = {r.process: r for r in self.run.process_records()}
            if name in records or time.monotonic() > deadline:
                return records.get(name)
            time.sleep(0.2)

    def signal_group(self, spec: ProcessSpec, pgid: int, sig: str) -> None:
        if self.lost(host_of(self.plan, spec)):
            return
        command = signal_command(str(self.run.root), str(pgid), sig)
        self.connection(host_of(self.plan, spec)).run(command, hide=True, warn=True, timeout=30)


def refuse_multiline_secrets(plan: Plan) -> None:
    """Secrets reach a remote worker as NAME=value lines on its stdin (never on a command line): a value with a
    line break cannot travel that way, and dropping it would start the process without it."""
    for name in sorted({s for p in plan.processes for s in p.secrets}):
        if "\n" in os.environ.get(name, ""):
            raise UserError(f"secret {name} holds a line break: the ssh target hands secrets to the hosts as one "
                            "NAME=value line each", hint=f"give {name} on one line (e.g. base64 it, and decode it "
                                                          "where it is read)")


def rendezvous_hosts(hosts: list[str]) -> list[str]:
    """Where the processes of each plan node are reached: loopback when every node is one host and that host is
    this machine (the supervisor's health checks and the clients then stay off the network); else the
    inventory's addresses, so that a server on another machine binds and is reached at its own address (bound
    to loopback there, nothing here could reach it)."""
    if len(set(hosts)) <= 1 and is_this_machine(hosts[0]):
        return single_host_or(hosts)
    return list(hosts)


def is_this_machine(host: str) -> bool:
    """Does `host` resolve to an address of this machine (loopback, or one a socket here can bind)?"""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    for address in addresses:
        if address.startswith("127."):
            return True
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


class SshTarget(SupervisedHere, Target):
    kind = "ssh"

    def provision(self, plan: Plan) -> None:
        refuse_multiline_secrets(plan)
        python = remote_python(plan)
        for host in dict.fromkeys(plan.target.hosts):
            conn = _open(connect(plan, host))
            try:
                found = conn.run(f"test -x {shell_path(python)}", hide=True, warn=True, timeout=30)
                if not found.ok:
                    raise UserError(f"ssh {host}: no primebuild interpreter at {python}",
                                    hint="install primebuild there (scripts/bootstrap in target.workdir)")
            finally:
                conn.close()

    def launch(self, run: RunDir, plan: Plan, *, echo: Echo, verbosity: int, live=None,
               avoid_hosts: tuple[str, ...] = ()) -> LaunchRecord:
        write_rendezvous(run, rendezvous_hosts(list(plan.target.hosts)))
        self.launcher = SshLauncher(plan, run)
        return self._start_supervisor(run, plan, self.launcher, echo=echo, verbosity=verbosity, live=live)

    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int):
        try:
            return self._watch()
        finally:
            for conn in self.launcher.connections.values():
                conn.close()

    def _alive_remote(self, run: RunDir, plan: Plan) -> list[tuple[ProcessSpec, int]]:
        launcher = SshLauncher(plan, run)
        marker = shlex.quote(f"PRIMEBUILD_RUN_DIR={run.root}")
        out = []
        for record in run.process_records():
            spec = plan.process(record.process)
            probe = launcher.connection(host_of(plan, spec)).run(
                f"tr '\\0' '\\n' < /proc/{record.pgid}/environ 2>/dev/null | grep -qxF -- {marker}",
                hide=True, warn=True, timeout=30)
            if probe.ok:
                out.append((spec, record.pgid))
        for conn in launcher.connections.values():
            conn.close()
        return out

    def active(self, run: RunDir, record: LaunchRecord) -> bool:
        return bool(self._alive_remote(run, read_plan(run.plan)))

    def stop(self, run: RunDir, record: LaunchRecord) -> str:
        plan = read_plan(run.plan)
        alive = self._alive_remote(run, plan)
        launcher = SshLauncher(plan, run)
        for spec, pgid in alive:
            launcher.signal_group(spec, pgid, "TERM")
        deadline = time.monotonic() + 10
        while alive and time.monotonic() < deadline and self._alive_remote(run, plan):
            time.sleep(0.5)
        for spec, pgid in self._alive_remote(run, plan):
            launcher.signal_group(spec, pgid, "KILL")
        for conn in launcher.connections.values():
            conn.close()
        return f"ended {', '.join(s.name for s, _ in alive)}" if alive else "nothing of the run was running"

    def state(self, run: RunDir, record: LaunchRecord) -> str:
        alive = self._alive_remote(run, read_plan(run.plan))
        return f"ssh: {len(alive)} process(es) running" if alive else "ssh: not running"
