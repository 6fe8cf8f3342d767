"""What the supervisor (primebuild/runtime/supervisor.py) starts processes through: a `Launcher` per target that
runs processes itself (local, and inside a Slurm job), and the `Handle` of each process it started.

Its own module, so that the supervisor depends on this interface and the targets on the supervisor,
never the other way round."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from primebuild.contracts.plan import ProcessSpec


class Handle(Protocol):
    """One started process (with everything it started)."""

    def poll(self) -> int | None: ...  # exit code, None while it runs

    def wait(self, timeout: float) -> int | None: ...  # exit code, None if still running after `timeout`

    def terminate(self) -> None: ...  # SIGTERM to its process group

    def kill(self) -> None: ...  # SIGKILL to its process group

    def lines(self) -> Iterator[str]: ...  # its output, line by line, until it exits

    def lost_contact(self) -> str | None: ...  # why its host cannot be reached any more (ssh), or None
    def lost_host(self) -> str | None: ...  # that host's address, or None


class Launcher(Protocol):
    def start(self, spec: ProcessSpec, env: dict[str, str]) -> Handle: ...
