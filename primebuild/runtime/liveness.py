"""Liveness of a run's HTTP servers once they are up: a live process can be a dead server.

vLLM's API server outlives its engine: when the EngineCore process dies it answers every request with
500 and /health with 503, and it may stay up that way (it only leaves once its connections close). The
embedded server's /health answers 503 once its engine thread has died. Such a server must be restarted
(or the run failed) like a process that exited, within seconds: the orchestrator would otherwise wait
on it for its whole retry window.

A probe thread per server asks its health URL every PROBE_SECONDS once the server was healthy. The
server is declared dead after DEAD_AFTER_ERRORS failures in a row, a failure being an error answer
(5xx), a refused connection (nothing listens: vLLM's API server stops listening once its engine died,
then waits for its clients' connections to close), or any missing answer after one of those; or when
nothing answered for UNRESPONSIVE_SECONDS (a server busy on 2 shared cores can miss a few probes, but
its socket still accepts).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROBE_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 5.0
DEAD_AFTER_ERRORS = 3
UNRESPONSIVE_SECONDS = 180.0
# a traceback's last line, maybe log-prefixed, maybe with the exception's module path; or the `error: …`
# line of one of our processes that ended on an error it reports without a traceback (config_main.py)
# `SomethingError: message`, our processes' `error: ...`, or an OS error a server logs without a class
# (uvicorn: "ERROR: [Errno 98] error while attempting to bind on address ...: address already in use")
_ERROR_LINE = re.compile(r"(?:^|\] )(?:\w+\.)*(\w+(?:Error|Exception): .+)|^error: (.+)|^ERROR:\s+(\[Errno \d+\] .+)")
START_MARKER = "--- start "  # the supervisor's line before each start of a process


class LivenessProbe:
    def __init__(self, name: str, url: str):
        self.name = name
        self.url = url
        self.cause: str | None = None  # set once the server is found dead
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        errors = 0
        what: list[str] = []  # the failures in a row, for the cause
        answered_at = time.monotonic()
        while not self._stopped.wait(PROBE_SECONDS):
            try:
                with urllib.request.urlopen(self.url, timeout=PROBE_TIMEOUT_SECONDS) as response:  # noqa: S310
                    status = response.status
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError as err:
                refused = isinstance(getattr(err, "reason", err), ConnectionRefusedError)
                status = "refused the connection" if refused else None
            if status is None and errors == 0:
                if time.monotonic() - answered_at > UNRESPONSIVE_SECONDS:
                    self.cause = f"{self.url} did not answer for {UNRESPONSIVE_SECONDS:.0f} s"
                    return
                continue
            answered_at = time.monotonic()
            failed = not isinstance(status, int) or status >= 500
            errors = errors + 1 if failed else 0
            if failed:
                what.append(f"answered {status}" if isinstance(status, int) else status or "no answer")
            else:
                what.clear()
            if errors >= DEAD_AFTER_ERRORS:
                self.cause = f"{self.url}: {', '.join(what[-errors:])} (its engine died)"
                return


def first_error_line(log: Path, tail_bytes: int = 500_000) -> str | None:
    """The first `SomethingError: message` line since the process last started: the root cause (what
    follows is its consequences, e.g. vLLM's EngineDeadError), for the terminal and failure.json."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARKER)]
    for line in lines[starts[-1] if starts else 0:]:
        match = _ERROR_LINE.search(line)
        if match:
            return next(g for g in match.groups() if g)[:300]
    return None
