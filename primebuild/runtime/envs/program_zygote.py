"""One sandboxed Python per process that forks harness programs with their imports already done.

verifiers' bash harness starts a Python program for every episode, and that program's imports (openai,
mcp, httpx) cost ~1.3 s of CPU before it says a word: measured over an RL run through the harness on 2
cores, ~80% of all the CPU the run used (bench/RESULTS.md, "bash-files"). Here one Python, started once,
imports them once and forks the program for each episode (zygote_main.py runs inside).

What is confined, and how:
- The zygote and every program it forks run in one bubblewrap sandbox (sandbox.py's binds, no network,
  the system read-only, environment cleared). Its only writable place is this process's episode root,
  which holds every episode's folder; its loopback carries each program's bridge to its own endpoints.
  The programs are the harness's code (verifiers'), not the model's, and each episode's program runs
  with the episode's rlimits, in its own session, in its episode's folder.
- Every command the model asks for runs in a sandbox of its own, nested in that one (the `bash` first on
  the program's PATH is a wrapper that starts bwrap): its episode's folder as /work and nothing else
  writable, no network at all (not even the program's endpoints), no /proc (the kernel refuses a new
  proc mount under the outer sandbox's masked one), `timeout` at the command's wall limit.
A program that outlives its episode's wall limit is killed with its process group and its commands.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from primebuild.runtime.envs.sandbox import PYTHON, VENV, Limits, bwrap, rlimits, system_binds

START_SECONDS = 60.0


class ProgramZygote:
    """The sandboxed zygote of this process (see the module docstring); `shared()` starts it on first use."""

    _shared: ProgramZygote | None = None

    @classmethod
    def shared(cls) -> ProgramZygote:
        if cls._shared is None or cls._shared.process.poll() is not None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="primebuild-episodes-"))  # every episode's folder, inside too
        support = self.root / ".zygote"
        support.mkdir()
        for name in ("zygote_main.py", "sandbox_bridge.py"):  # standard library only: they run inside
            shutil.copyfile(Path(__file__).with_name(name), support / name)
        self.control = support / "control.sock"
        self.log = support / "stderr"
        self.preloaded: set[str] = set()
        argv = [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", *system_binds(),
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(self.root), str(self.root),
                "--ro-bind", sys.prefix, VENV, "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--remount-ro", "/", "--",
                PYTHON, str(support / "zygote_main.py"), str(self.control)]
        with open(self.log, "wb") as log:  # --die-with-parent: started from this thread, it ends with it
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                            start_new_session=True)
        ready, _, _ = select.select([self.process.stdout], [], [], START_SECONDS)
        if not ready or self.process.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError(f"the sandbox's program zygote did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:] or "no output"
        except OSError:
            return "no output"

    async def _ask(self, message: dict, timeout: float | None = None) -> dict | None:
        """One request; None when `timeout` passed first (the connection closes: the zygote ends the child)."""
        reader, writer = await asyncio.open_unix_connection(str(self.control))
        try:
            writer.write(json.dumps(message).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout)
        except TimeoutError:
            return None
        finally:
            writer.close()
        if not line:
            raise RuntimeError(f"the sandbox's program zygote ended: {self._log_tail()}")
        return json.loads(line)

    async def preload(self, modules: list[str]) -> None:
        """Import a program's dependencies in the zygote, once, so that every program forked after has them."""
        missing = [m for m in modules if m not in self.preloaded]
        if missing:
            answer = await self._ask({"preload": missing}, timeout=START_SECONDS)
            if answer is None:
                raise RuntimeError(f"the sandbox's program zygote did not import {missing} in {START_SECONDS:.0f} s: "
                                   f"{self._log_tail()}")
            if "error" in answer:
                raise RuntimeError(f"the sandbox's program zygote could not import {missing}: {answer['error']}")
            self.preloaded.update(missing)

    def command_wrapper(self, folder: Path, work: Path, command_seconds: int) -> Path:
        """`folder`/bash: what a program's `bash -c COMMAND` runs, a nested sandbox over `work` (see above)."""
        nested = [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", *system_binds(), "--dev", "/dev",
                  "--tmpfs", "/tmp", "--bind", str(work), "/work", "--chdir", "/work",
                  "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
                  "--remount-ro", "/", "--", "timeout", "-k", "1", str(command_seconds), "/bin/bash"]
        wrapper = folder / "bash"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(nested)} "$@"\n')
        wrapper.chmod(0o755)
        return wrapper

    async def run(self, script: Path, args: list[str], *, cwd: Path, env: dict[str, str], routes: dict[int, Path],
                  limits: Limits, output: Path) -> tuple[int | None, str, str]:
        """Fork `script` as __main__ with `args`; (returncode or None when killed at the wall limit, stdout,
        stderr), each output's last `limits.output_bytes`. `output` is a folder for the two files."""
        stdout, stderr = output / "stdout", output / "stderr"
        answer = await self._ask({
            "script": str(script), "args": list(args), "cwd": str(cwd), "env": env,
            "stdout": str(stdout), "stderr": str(stderr), "routes": {str(p): str(s) for p, s in routes.items()},
            "rlimits": rlimits(limits)}, timeout=limits.wall_seconds)
        cap = limits.output_bytes

        def tail(path: Path) -> str:
            try:
                return path.read_bytes()[-cap:].decode(errors="replace")
            except OSError:
                return ""
        return (None if answer is None else answer["returncode"]), tail(stdout), tail(stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
