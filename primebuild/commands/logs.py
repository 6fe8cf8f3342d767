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
    from primebuild.runtime.targets import ended_outcome, target_for
    from primebuild.runtime.targets.base import TargetUnanswered
    from primebuild.runtime.targets.stopping import UNANSWERED_NOTICE_SECONDS

    run = find_run(run_dir, runs_dir)
    run_dir = run.root
    logs_dir = run.logs
    if not logs_dir.is_dir():
        raise UserError(f"{run_dir} has no logs/ folder", hint="is it a run folder? (runs/<name>-<time>)")
    files = _logs(logs_dir, process)
    if process is not None and not files:
        known = ", ".join(f.stem for f in _logs(logs_dir, None))
        raise UserError(f"no log for process {process!r} in {run_dir}", hint=f"processes: {known}")
    if not files:
        click.echo(f"no process of {run_dir} has written a log yet" + ("; waiting (Ctrl-C to stop)" if follow else ""))
    offsets = {}
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError as err:
            raise UserError(f"cannot read {f}: {err.strerror}") from None
        for line in text.splitlines()[-lines:]:
            click.echo(_prefix(f, files) + line)
        offsets[f] = len(text.encode())
    gone_polls = 0  # polls in a row that found the session over without an outcome
    told = float("-inf")  # when it last said that the target does not answer
    while follow:
        time.sleep(0.5)
        record = run.read_launch()
        try:
            ended = ended_outcome(run, record)  # before the last chunks: they are shown, then the end
            # a session that ended without recording an outcome (a Slurm job cancelled or out of time, a killed
            # supervisor) stays over: nothing holds the folder, its target runs nothing of it (with an outcome,
            # ended_outcome would have returned it)
            over = ended is None and record is not None and not run.claimed() \
                and not target_for(record.target).active(run, record)
        except TargetUnanswered as err:  # slurmctld busy, an API server timing out: the logs go on; ask again
            ended, over = None, False
            if time.monotonic() - told >= UNANSWERED_NOTICE_SECONDS:
                click.echo(f"warning: {err.problems[0].message}; asking again", err=True)
                told = time.monotonic()
        gone_polls = gone_polls + 1 if over else 0
        for f in _logs(logs_dir, process):  # a process that started since (a replica `scale` added)
            if f not in offsets:
                offsets[f] = 0
        for f in list(offsets):
            try:
                with open(f, "rb") as handle:
                    if handle.seek(0, 2) < offsets[f]:  # cut short (a new session's log): from its start
                        offsets[f] = 0
                    handle.seek(offsets[f])
                    chunk = handle.read()
            except OSError as err:
                click.echo(f"{f.name}: {'removed' if isinstance(err, FileNotFoundError) else err.strerror}; "
                           "no longer followed")
                del offsets[f]
                continue
            offsets[f] += len(chunk)
            for line in chunk.decode(errors="replace").splitlines():
                click.echo(_prefix(f, list(offsets)) + line)
        if ended is not None:
            click.echo(f"the run has ended: {ended.message}")
            return
        if gone_polls >= 4:  # two seconds: not a session between its launch and its record
            click.echo(f"the run is not running and recorded no outcome: `primebuild status {run.root}` says what "
                       "is known; `primebuild run --resume` continues it")
            return


def _logs(logs_dir: Path, process: str | None) -> list[Path]:
    """The run's process logs (files only), or the one of `process`."""
    return sorted(f for f in logs_dir.glob("*.log") if f.is_file() and (process is None or f.stem == process))


def _prefix(log: Path, shown: list[Path]) -> str:
    return f"[{log.stem}] " if len(shown) > 1 else ""
