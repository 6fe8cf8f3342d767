"""A rollout's sandbox: its own folder, and every program it runs confined by bubblewrap and rlimits.

What the field uses to run untrusted agent code on Linux without a container engine: bubblewrap (the
sandbox of Flatpak, and of coding agents' shell tools) puts each process in new user, PID, network,
IPC, UTS and cgroup namespaces. Inside, the system's /usr is read-only, the rollout's folder is the
only writable place (mounted at /work), /tmp is a private tmpfs, there is no network at all (only a
loopback device of its own) and the environment is cleared (no token or secret of the run leaks in).
rlimits bound what a program can take: CPU seconds (SIGXCPU, then SIGKILL), address space (allocations
fail), file size and open files. A wall-clock timeout kills the whole sandbox (its PID namespace dies
with its first process), for a program that sleeps or blocks instead of spinning.

A program that breaks out of these limits is ended, reported as such, and leaves nothing running; the
caller scores it (swe-tiny: 0) and the run goes on.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from primebuild.errors import UserError

WORKDIR = "/work"  # where the rollout's folder appears inside the sandbox
VENV = "/opt/primebuild-venv"  # where a sandbox given this project's virtual environment sees it (read-only)
PYTHON = f"{VENV}/bin/python{sys.version_info.major}.{sys.version_info.minor}"  # a venv's, or a system prefix's


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 10
    wall_seconds: float = 30.0
    memory_bytes: int = 1 << 30  # address space: Python itself maps ~30 MB before any test runs
    file_bytes: int = 16 << 20
    open_files: int = 256
    output_bytes: int = 64 << 10  # of stdout and stderr each, kept for the caller


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise UserError("the sandbox needs bubblewrap (`bwrap`), which is not installed",
                        hint="apt-get install bubblewrap (scripts/bootstrap --test installs it)")
    return path


def python_in_sandbox() -> str:
    """The base interpreter (not a virtual environment's, which lives outside the read-only system)."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(Path(sys.base_prefix) / "bin" / name)


def system_binds() -> list[str]:
    """bwrap arguments that show the system read-only: /usr, its merged-/usr links, and the base interpreter."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: /bin -> usr/bin, ...
        target = Path("/") / link
        if target.is_symlink():
            args += ["--symlink", os.readlink(target), str(target)]
        elif target.is_dir():
            args += ["--ro-bind", str(target), str(target)]
    prefix = Path(sys.base_prefix)
    if not str(prefix).startswith("/usr"):  # an interpreter installed elsewhere (uv, pyenv)
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


def rlimits(limits: Limits) -> list[tuple[str, int, int]]:
    """The rlimits a confined process gets, as (resource name, soft, hard)."""
    return [("RLIMIT_CPU", limits.cpu_seconds, limits.cpu_seconds + 1),  # SIGXCPU, then SIGKILL
            ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
            ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
            ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
            ("RLIMIT_CORE", 0, 0)]


class Sandbox:
    """A temporary folder for one rollout, and the confined programs run in it."""

    def __init__(self, limits: Limits = Limits(), prefix: str = "primebuild-sandbox-",
                 read_only: dict[str, str] | None = None, parent: Path | None = None):
        self.limits = limits
        self.read_only = dict(read_only or {})  # host path -> where it appears inside, read-only
        self._bwrap = bwrap()
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))

    def path(self, name: str) -> Path:
        """A file of the sandbox by relative name; anything that resolves outside it is refused."""
        target = (self.root / name).resolve()
        if target != self.root.resolve() and self.root.resolve() not in target.parents:
            raise ValueError(f"{name!r} is outside the sandbox")
        return target

    def _argv(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        args = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", *system_binds()]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(self.root), WORKDIR,
                 "--chdir", WORKDIR, "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                 "--setenv", "HOME", WORKDIR, "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        for source, target in self.read_only.items():
            args += ["--ro-bind", source, target]
        for name, value in (env or {}).items():
            args += ["--setenv", name, value]
        args += ["--remount-ro", "/", "--", *argv]  # the root itself read-only too: only /work and /tmp take writes
        return args

    def _limit(self) -> None:  # runs in the child between fork and exec; inherited by everything inside
        for name, soft, hard in rlimits(self.limits):
            resource.setrlimit(getattr(resource, name), (soft, hard))

    async def run(self, argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> Result:
        timeout = self.limits.wall_seconds if timeout is None else timeout
        proc = await asyncio.create_subprocess_exec(
            *self._argv(argv, env), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=self._limit, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
            timed_out = False
        except (TimeoutError, asyncio.CancelledError) as stop:
            _kill(proc)
            out, err = await proc.communicate()
            if isinstance(stop, asyncio.CancelledError):
                raise
            timed_out = True
        cap = self.limits.output_bytes
        return Result(None if timed_out else proc.returncode, out[-cap:].decode(errors="replace"),
                      err[-cap:].decode(errors="replace"), timed_out)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """bwrap leads the session; its sandbox's first process dies with it (--die-with-parent), and with
    that process the whole PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
