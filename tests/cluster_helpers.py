"""What the `cluster` tests share: the services scripts/ci-services starts, and the run helpers.

Under CI=true a missing service FAILS the test (.ci/run starts them, so missing means broken); on a
developer machine it skips, saying why and how to start it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SSH_DIR = Path(os.environ.get("PRIMEBUILD_CI_SSH_DIR", "/var/lib/primebuild-ci/ssh"))
SSH_HOSTS = ("127.0.0.2", "127.0.0.3")
# Three hosts as network namespaces pbhost1-3 (scripts/ci-hosts): own addresses, one shared filesystem.
NETNS_HOSTS = ("10.77.0.1", "10.77.0.2", "10.77.0.3")
NAMESPACES = ("pbhost1", "pbhost2", "pbhost3")  # also the names of their root-side veth ends
# A run folder path full of what a shell would interpret: every artifact must quote it.
NASTY = "runs it's $(touch PWNED) `touch PWNED2`; x"


def missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: .ci/run starts it with scripts/ci-services)")
    pytest.skip(f"{reason}; start it with `scripts/ci-services` (as root)")


def require_slurm() -> None:
    if shutil.which("sbatch") is None:
        missing("Slurm is not installed (no sbatch)")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    if "UP" not in ping.stdout:
        missing(f"slurmctld does not answer: {ping.stdout.strip() or ping.stderr.strip()}")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    idle = [line for line in nodes.stdout.splitlines() if line.split()[1].startswith(("idle", "mix", "alloc"))]
    if len(idle) < 3:
        missing(f"need 3 Slurm nodes up (a het job gives each component its own), have: {nodes.stdout.strip()}")


def require_sshd() -> Path:
    config = SSH_DIR / "config"
    if not config.is_file():
        missing(f"no ssh client config at {config}")
    for host in SSH_HOSTS:
        probe = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host,
                                "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            missing(f"sshd on {host}:2222 does not answer: {probe.stderr.strip()}")
    return config


def require_netns_hosts() -> Path:
    """The three namespace hosts, each answering over ssh from here."""
    config = SSH_DIR / "config"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    absent = [ns for ns in NAMESPACES if ns not in listed.split()]
    if absent or not config.is_file():
        missing(f"no network namespace host(s) {', '.join(absent) or '(no ssh config)'}")
    for host in NETNS_HOSTS:
        probe = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host,
                                "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            missing(f"sshd on {host}:2222 (its network namespace) does not answer: {probe.stderr.strip()}")
    return config


def namespace_pids(namespace: str) -> set[int]:
    """Processes whose network is that of `namespace` (`ip netns pids`)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=20)
    return {int(pid) for pid in listed.stdout.split()}


def namespace_of(pid: int, namespaces) -> str:
    """The one namespace of `namespaces` that `pid` runs in (or "? [...]" naming what was found)."""
    found = [ns for ns in namespaces if pid in namespace_pids(ns)]
    return found[0] if len(found) == 1 else f"? {found}"


def where_the_run_is(run_dir: Path, pids: list[int], namespaces) -> tuple[dict[str, str], list[tuple[int, str, str, int]]]:
    """While a run runs on namespace hosts: {plan process: its namespace} from the run's pid records, and
    (pid, namespace, local address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    placed = {}
    for record in (run_dir / "pids").glob("*.json"):
        data = json.loads(record.read_text())
        placed[data["process"]] = namespace_of(data["pid"], namespaces)
    sockets = listening_sockets(pids)
    namespace = {pid: namespace_of(pid, namespaces) for pid in {pid for pid, _, _ in sockets}}
    return placed, [(pid, namespace[pid], address, port) for pid, address, port in sockets]


def cli(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primebuild.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def start(*args: str, env: dict, output: Path | None = None) -> subprocess.Popen:
    """`primebuild ARGS` in the background; its output in a pipe, or in the file `output` (to read while it runs)."""
    argv = [sys.executable, "-m", "primebuild.cli", *map(str, args)]
    if output is None:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    with open(output, "wb") as sink:  # the child holds its own copy
        return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)


def run_dir_of(runs: Path) -> Path:
    (found,) = [p for p in runs.iterdir() if p.is_dir()]
    return found


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return sorted(r["step"] for r in rows if r["role"] == "trainer" and r["name"] == "loss")


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["value"] for r in sorted(rows, key=lambda r: r["step"])
            if r["role"] == "orchestrator" and r["name"] == "reward_mean"]


def wait_trained(runs: Path, step: int, proc: subprocess.Popen | None, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stdout.read() if proc.stdout else ''}")
        dirs = [p for p in runs.iterdir() if p.is_dir()] if runs.exists() else []
        if dirs and step in trained_steps(dirs[0]):
            return dirs[0]
        time.sleep(0.3)
    raise AssertionError(f"step {step} was not trained within {timeout} s")


def kill_the_trainer_keeping_the_rest(run_dir: Path, runs: Path, proc: subprocess.Popen, timeout: float) -> list[int]:
    """SIGKILL the trainer of a running run and wait for the next step: the inference server and the orchestrator
    are the same processes after its restart. Returns [the newest step trained when it died]."""
    others = ("primebuild.runtime.inference.server", "primebuild.runtime.orchestrator.main")
    kept = {name: pid_of(run_dir, name) for name in others}
    kills = [trained_steps(run_dir)[-1]]
    os.kill(pid_of(run_dir, "primebuild.runtime.trainer.main"), signal.SIGKILL)
    wait_trained(runs, kills[0] + 1, proc, timeout=timeout)
    assert {name: pid_of(run_dir, name) for name in others} == kept
    return kills


def processes_of(run_dir: Path) -> list[str]:
    """Live processes that belong to the run: its folder in their environment or command line."""
    found = []
    needle = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or b"PRIMEBUILD_RUN_DIR=" + needle in environ:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
            found.append(f"{entry.name}: {shown}")
    return found


def pid_of(run_dir: Path, needle: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline and f"PRIMEBUILD_RUN_DIR={run_dir}".encode() in environ.split(b"\0"):
            return int(entry.name)
    raise AssertionError(f"no process {needle} for {run_dir}")


def wait_gone(run_dir: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = processes_of(run_dir)
        if not left:
            return []
        time.sleep(0.5)
    return processes_of(run_dir)


def logs_tail(run_dir: Path) -> str:
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="ignore").splitlines()[-20:]))
    return "\n".join(out)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    # each pid's own tables: a process in another network namespace lists its sockets only there
    tables = {f"/proc/{pid}/net/{name}" for pid in set(inodes.values()) for name in ("tcp", "tcp6")}
    rows = set()
    for table in tables:
        try:
            rows |= set(Path(table).read_text().splitlines()[1:])
        except OSError:
            continue
    for line in rows:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state != "0A" or inode not in inodes:  # 0A: LISTEN
            continue
        address, port = local.split(":")
        raw = bytes.fromhex(address)
        # /proc prints each 32-bit word in host (little-endian) order
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        out.append((inodes[inode], str(ipaddress.ip_address(words)), int(port, 16)))
    return out
