"""Trainer metrics as JSON lines in ``<run_dir>/metrics.jsonl``, the run's one metrics file.

One line per metric and step: ``{"step": k, "role": "trainer", "name": "loss", "value": 0.12}``. The
orchestrator appends its own lines (role "orchestrator") to the same file: each step's lines go out in
one ``write`` on a file opened for appending, so concurrent writers do not interleave inside a line.
After a resume a step may appear twice; readers keep the last line per (role, step, name). A process
killed while writing may leave a torn last line: readers skip it, and a resumed run cuts it off first.

The same values go to the experiment trackers the manifest names (`sinks`, see primebuild/runtime/trackers/).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from primebuild.errors import Problem, UserError


class MetricsWriter:
    def __init__(self, path: str | os.PathLike, enabled: bool = True, role: str = "trainer",
                 sinks: Sequence[Any] = ()):
        self.path = Path(path)
        self.enabled = enabled
        self.role = role
        self.sinks = list(sinks)  # primebuild/runtime/trackers: objects with log(step, values) and close()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        lines = []
        for name, value in values.items():
            value = float(value)
            # JSON has no NaN/inf: write null rather than an invalid line.
            lines.append(
                json.dumps(
                    {
                        "step": step,
                        "role": self.role,
                        "name": name,
                        "value": value if math.isfinite(value) else None,
                    }
                )
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
        finally:
            os.close(fd)
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        """Flush and close the trackers (wandb finishes its run); metrics.jsonl needs nothing."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every complete row of the file, in order: a torn line, or one that is not a metric (an edit by
    hand), is skipped; no file is no rows."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise UserError(Problem(f"cannot read the metrics: {err.strerror}", file=str(path))) from None
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if _is_metric(row):
            rows.append(row)
    return rows


def _is_metric(row: object) -> bool:
    """{"step": int, "role": str, "name": str, "value": ...}, as MetricsWriter writes them."""
    return (isinstance(row, dict) and isinstance(row.get("role"), str) and isinstance(row.get("name"), str)
            and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool) and "value" in row)


def read_metrics(path: str | os.PathLike, role: str = "trainer") -> dict[int, dict[str, float | None]]:
    """{step: {name: value}} of one role, last line winning (see module docstring)."""
    out: dict[int, dict[str, float | None]] = {}
    for row in read_rows(path):
        if row["role"] == role:
            out.setdefault(row["step"], {})[row["name"]] = row["value"]
    return out


def cut_torn_tail(path: str | os.PathLike) -> int:
    """Remove a last line without its newline: a write cut short by a kill (Linux ends a write to a file
    early when a fatal signal arrives between pages). The next append would otherwise be glued to it and
    be unreadable too. Only while nobody appends (at the start of a session). Returns the bytes removed."""
    path = Path(path)
    data = path.read_bytes() if path.is_file() else b""
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    os.truncate(path, keep)
    return len(data) - keep
