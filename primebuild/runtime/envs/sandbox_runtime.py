"""A verifiers Runtime whose programs run in primebuild's bubblewrap sandbox (sandbox.py).

verifiers' `bash` harness is a chat program that runs every shell command the model asks for as its own
child process. verifiers' SubprocessRuntime would run it on this host as the trainer's user; here
every program a rollout launches (the harness program, and so each command) runs confined instead:
new namespaces, no network, the rollout's folder as the only writable place (/work inside), rlimits.

Two ways in:
- The harness program (what `prepare_uv_script` returned) is forked by this process's program zygote
  (program_zygote.py): one sandboxed Python that imported the program's dependencies once, so an episode
  does not pay ~1.3 s of CPU for openai and mcp. Each command the program runs is a sandbox of its own,
  nested: the episode's folder as /work, no network, `timeout` at `command_seconds`.
- Anything else `run` is given (a task's setup, a test of the model's code) runs in a bubblewrap sandbox
  of its own over the same folder, with sandbox_bridge.py in front of it for the routes.

What a verifiers Runtime must do, and how this one does it:
- `start`/`teardown`: the sandbox folder is created and removed; `write`/`_read` are file I/O in it.
- `run`: argv confined as above, with the runtime's env; wall limit `wall_seconds`.
- `prepare_uv_script`: verifiers would have uv install the script's dependencies (PEP 723) from the
  network. The sandbox has none, so the script runs with this project's own interpreter instead (its
  virtual environment, bound read-only at /opt/primebuild-venv), after checking that every dependency the
  script declares is importable here (a missing one is a clear error naming it); the zygote imports them.
- `host_url`/`prepare_execution`: the model's endpoint is verifiers' interception server on this host.
  `prepare_execution` receives exactly the routes the agent needs (the interception, MCP servers) and
  opens one unix socket per route; inside, a bridge (sandbox_bridge.py: a thread of the forked program,
  or a process in front of any other) listens on the sandbox's loopback at each route's port and pipes to
  its socket. No other address is reachable, and a command reaches none at all.

Limits (`SandboxLimits`): `cpu_seconds` and `memory_mb` bound every process (the program and each
command, each counted on its own: RLIMIT_CPU/RLIMIT_AS); `command_seconds` is each shell command's wall
time (the `bash` the program runs is a wrapper that puts it under `timeout`); `wall_seconds` bounds the
whole episode (the program is killed with its commands). A command killed by its limits comes back to the
model as a tool result; an episode over its wall time ends and is scored 0 (verifiers_agents.py). The run
goes on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from verifiers.v1.runtimes import ProgramResult, SubprocessConfig, SubprocessRuntime

from primebuild.errors import UserError
from primebuild.runtime.envs import sandbox_bridge
from primebuild.runtime.envs.program_zygote import ProgramZygote
from primebuild.runtime.envs.sandbox import PYTHON, VENV, WORKDIR, Limits, Sandbox

SUPPORT = "/opt/primebuild"  # inside: the bridge, the bash wrapper, the route sockets (read-only)
WALL_KILLED = 137  # the exit code run() reports for a program killed at the episode's wall limit
SCRIPT_DEPENDENCIES = re.compile(r"^# dependencies = \[(.*)\]$", re.MULTILINE)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 10
    memory_mb: int = 2048  # address space: the harness program (openai, mcp, httpx) maps a few hundred MB
    command_seconds: int = 10
    wall_seconds: int = 120

    def sandbox_limits(self) -> Limits:
        return Limits(cpu_seconds=self.cpu_seconds, wall_seconds=float(self.wall_seconds),
                      memory_bytes=self.memory_mb << 20)


class SandboxRuntime(SubprocessRuntime):
    """One rollout's sandbox; see the module docstring. Its config reads as `subprocess` to verifiers
    (a local program, no container), which is what it is, confined."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), name: str | None = None):
        super().__init__(SubprocessConfig(), name)
        self.limits = limits
        self.sandbox: Sandbox | None = None
        self.support: Path | None = None
        self._routes: dict[int, Path] = {}  # port -> host socket
        self._servers: list[asyncio.AbstractServer] = []
        self._program: list[str] | None = None  # what prepare_uv_script returned: run() forks it in the zygote
        self.wall_killed = False  # a program of this rollout ran past wall_seconds

    async def start(self) -> None:
        self.zygote = ProgramZygote.shared()
        self.support = Path(tempfile.mkdtemp(prefix="primebuild-bash-support-", dir=self.zygote.root))
        for folder in ("bin", "routes", "forked"):
            (self.support / folder).mkdir()
        shutil.copyfile(sandbox_bridge.__file__, self.support / "bridge.py")
        bash = self.support / "bin" / "bash"  # first on PATH inside: each command the program runs, timed
        bash.write_text(f'#!/bin/sh\nexec timeout -k 1 {self.limits.command_seconds} /bin/bash "$@"\n')
        bash.chmod(0o755)
        self.sandbox = Sandbox(self.limits.sandbox_limits(), prefix="primebuild-bash-", read_only={
            str(self.support): SUPPORT, sys.prefix: VENV}, parent=self.zygote.root)
        self.zygote.command_wrapper(self.support / "forked", self.sandbox.root, self.limits.command_seconds)
        self.workdir = self.sandbox.root
        self.info.id = str(self.workdir)

    def _path(self, path: str) -> Path:
        """A path the program names (relative, or absolute under /work) as a file of the sandbox folder."""
        if path.startswith(WORKDIR + "/"):
            path = path[len(WORKDIR) + 1:]
        if os.path.isabs(path):
            raise UserError(f"sandbox: {path!r} is outside the rollout's folder ({WORKDIR})")
        return self.sandbox.path(path)

    async def write(self, path: str, data: bytes) -> None:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        data = await asyncio.to_thread(self._path(path).read_bytes)
        return data if max_bytes is None else data[:max_bytes]

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {**self.process_env(env), "PATH": f"{SUPPORT}/bin:/usr/local/bin:/usr/bin:/bin"}

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        """The harness program (what prepare_uv_script returned) is forked by the zygote; anything else (a
        task's setup, a test of the model's code) runs in a bubblewrap sandbox of its own."""
        if self._program is not None and argv[:len(self._program)] == self._program:
            returncode, stdout, stderr = await self.zygote.run(
                Path(self._program[1]), argv[len(self._program):], cwd=self.sandbox.root, routes=self._routes,
                env={**self.process_env(env), "HOME": str(self.sandbox.root), "PYTHONDONTWRITEBYTECODE": "1",
                     "PATH": f"{self.support / 'forked'}:/usr/local/bin:/usr/bin:/bin"},
                limits=self.limits.sandbox_limits(), output=self.support)
        else:
            bridge = [f"{port}={SUPPORT}/routes/{sock.name}" for port, sock in self._routes.items()]
            result = await self.sandbox.run([PYTHON, f"{SUPPORT}/bridge.py", *bridge, "--", *argv],
                                            env=self._env(env))
            returncode, stdout, stderr = (None if result.timed_out else result.returncode), result.stdout, result.stderr
        if returncode is None:
            self.wall_killed = True
            return ProgramResult(WALL_KILLED, stdout, stderr + f"\nsandbox: killed at the episode's "
                                 f"wall limit ({self.limits.wall_seconds} s)")
        return ProgramResult(returncode, stdout, stderr)

    async def open_process(self, argv, env):
        raise NotImplementedError("the sandbox runs programs to completion only (no live processes)")

    async def run_background(self, argv, env, log):
        raise NotImplementedError("the sandbox hosts no tool servers: a taskset's MCP tools run on the host")

    async def prepare_uv_script(self, script, env=None, *, activate: bool = True) -> list[str]:
        text = script.decode() if isinstance(script, bytes) else script
        missing = [name for name in script_dependencies(text) if importlib.util.find_spec(name) is None]
        if missing:
            raise UserError(f"the sandboxed harness program needs {', '.join(missing)}, which this environment "
                            "lacks (the sandbox has no network to install them)",
                            hint=f"install {' '.join(missing)} into the run's environment")
        await self.zygote.preload(script_dependencies(text))
        program = self.support / "program.py"
        program.write_text(text)
        self._program = [PYTHON, str(program)]
        return list(self._program)

    def host_url(self, url: str) -> str:
        parts = urlsplit(url)  # the sandbox has no /etc/hosts: name the loopback by number
        return parts._replace(netloc=parts.netloc.replace("localhost", "127.0.0.1")).geturl()

    async def prepare_execution(self, routes: list[str] | None) -> None:
        for route in routes or []:
            parts = urlsplit(route)
            if parts.port is None or parts.port in self._routes:
                continue
            if parts.hostname not in ("127.0.0.1", "localhost"):
                raise UserError(f"sandbox: the agent's route {route} is not on this host's loopback")
            sock = self.support / "routes" / f"{parts.port}.sock"
            self._servers.append(await asyncio.start_unix_server(
                sandbox_bridge.forwarder(lambda port=parts.port: asyncio.open_connection("127.0.0.1", port)), path=str(sock)))
            self._routes[parts.port] = sock

    async def teardown(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []
        self.cleanup()

    def cleanup(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        if self.support is not None:
            shutil.rmtree(self.support, ignore_errors=True)


def script_dependencies(script: str) -> list[str]:
    """The import names of a PEP 723 script's dependencies (`mcp==2.0.0` -> mcp)."""
    found = SCRIPT_DEPENDENCIES.search(script)
    if not found:
        return []
    names = [re.split(r"[<>=!~\[; ]", item.strip().strip('"'))[0] for item in found.group(1).split(",")]
    return [name.replace("-", "_") for name in names if name]
