"""`primebuild logs [RUN_DIR] [--process NAME] [-f]`: the per-process logs of a run (default: the newest)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from primebuild.commands.options import run_dir_argument, runs_dir_option
from primebuild.contracts.run_dir import find_run
from primebuild.errors import UserError


@click.command("logs")
@run_dir_argument
@runs_dir_option
@click.option("-p", "--process", default=None, help="Only this process's log (e.g. trainer, inference-0).")
@click.option("-n", "--lines", default=40, show_default=True, type=click.IntRange(min=1), help="Lines from the end of each log.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
def command(run_dir: Path | None, runs_dir: Path, process: str | None, lines: int, follow: bool) -> None:
    """Print the last lines of every process log of RUN_DIR (default: the newest run), or of one process."""
    run = find_run(run_dir, runs_dir)
    run_dir = run.root
    logs_dir = run.logs
    if not logs_dir.is_dir():
        raise UserError(f"{run_dir} has no logs/ folder", hint="is it a run folder? (runs/<name>-<time>)")
    files = sorted(logs_dir.glob("*.log"))
    if process is not None:
        files = [f for f in files if f.stem == process]
        if not files:
            known = ", ".join(f.stem for f in sorted(logs_dir.glob("*.log")))
            raise UserError(f"no log for process {process!r} in {run_dir}", hint=f"processes: {known}")
    offsets = {}
    for f in files:
        text = f.read_text(errors="replace")
        prefix = f"[{f.stem}] " if len(files) > 1 else ""
        for line in text.splitlines()[-lines:]:
            click.echo(prefix + line)
        offsets[f] = len(text.encode())
    while follow:
        time.sleep(0.5)
        for f in files:
            with open(f, "rb") as handle:
                handle.seek(offsets[f])
                chunk = handle.read()
            offsets[f] += len(chunk)
            for line in chunk.decode(errors="replace").splitlines():
                click.echo((f"[{f.stem}] " if len(files) > 1 else "") + line)
