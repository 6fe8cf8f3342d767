"""Thread stacks of a run's Python processes, on request: what a hung run was doing.

Each process of a plan calls `dump_on_signal()` first thing: SIGUSR1 then makes faulthandler write every
thread's stack to `stacks/<process>.<pid>.txt` in the run folder. faulthandler writes from the C
signal handler itself, so a process blocked inside a collective, a socket read or a CUDA call still
answers (a Python-level handler would wait for the blocked call to return). The supervisor's hang
watchdog (primebuild/runtime/hang_watchdog.py) signals only processes whose SigCgt mask shows the handler, so a
process that never installed it (vLLM's engine core, a shell) is not killed by SIGUSR1's default action.

`waits_on(stack)` reads a dump's innermost frames and says what the thread waits on, in words.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from primebuild.contracts.run_dir import RunDir

PROCESS_ENV = "PRIMEBUILD_PROCESS"  # the plan process a pid belongs to (set by the worker, inherited)
RUN_DIR_ENV = "PRIMEBUILD_RUN_DIR"
DUMP_SIGNAL = signal.SIGUSR1

_open_files = []  # faulthandler keeps the descriptor, not the file object: keep it open for the process's life


def dump_on_signal() -> None:
    """Install the SIGUSR1 stack dump into this run's stacks/ folder (no-op outside a run)."""
    run_dir, process = os.environ.get(RUN_DIR_ENV), os.environ.get(PROCESS_ENV)
    if not run_dir or not process:
        return
    path = RunDir(run_dir).stack_file(process, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    out = open(path, "a")  # noqa: SIM115 (open until the process ends)
    _open_files.append(out)
    faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)


# --- the supervisor's side -------------------------------------------------------------------------


@dataclass
class Frame:
    file: str
    line: int
    function: str


@dataclass
class Thread:
    header: str  # e.g. "Current thread 0x00007f... (most recent call first):"
    frames: list[Frame]  # innermost first, as faulthandler writes them


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')


def parse_dump(text: str) -> list[Thread]:
    """The threads of one dump (the caller reads only what the process wrote since it asked)."""
    threads: list[Thread] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append(Thread(line, []))
        elif threads and (m := _FRAME.match(line)):
            threads[-1].frames.append(Frame(m["file"], int(m["line"]), m["function"]))
    return threads


# What a thread waits on, from the innermost frame whose "path:function" matches -> words.
_WAITS = [
    (re.compile(r"torch/distributed/.*(distributed_c10d|_functional_collectives|fsdp)"), "a collective"),
    (re.compile(r"weight_sync/"), "a weight update"),
    (re.compile(r"(http/client|urllib/request|httpx|httpcore|aiohttp|requests/)"), "an HTTP call"),
    (re.compile(r"trainer/.*:wait_for_batch$"), "a rollout batch from the orchestrator"),
    # asyncio: the awaited calls (HTTP to the servers, say) are coroutines, on no thread's stack
    (re.compile(r"selectors\.py:select$"), "its event loop's sockets"),
]


def waits_on(thread: Thread) -> str | None:
    """'a collective (all_reduce at distributed_c10d.py:2950)', or None when nothing known matches."""
    for frame in thread.frames:
        where = f"{frame.file.replace(os.sep, '/')}:{frame.function}"
        for pattern, what in _WAITS:
            if pattern.search(where):
                return f"{what} ({frame.function} at {Path(frame.file).name}:{frame.line})"
    return None


def main_thread(threads: list[Thread]) -> Thread | None:
    """The thread that runs the process's own loop: the one faulthandler lists last (the oldest)."""
    return threads[-1] if threads else None
