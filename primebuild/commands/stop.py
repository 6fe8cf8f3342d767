"""`primebuild stop [RUN_DIR]`: stop a run gracefully, on any target (what Ctrl-C does).

Writes RUN_DIR/STOP: the trainer checkpoints after its current step and the orchestrator stops, so the
run ends by itself and `primebuild run --resume` continues it. What still runs after `--grace` seconds
is ended by the run's target (Slurm: scancel; ssh and local: the process groups the workers recorded).
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from primebuild.commands.options import run_dir_argument, runs_dir_option
from primebuild.contracts.run_dir import find_run

POLL_SECONDS = 0.5


@click.command("stop")
@run_dir_argument
@runs_dir_option
@click.option("--grace", type=click.FloatRange(min=0, max=3600), default=60.0, show_default=True,
              help="Seconds the run may take to checkpoint and end by itself before its target ends it.")
@click.option("--now", is_flag=True, help="No grace: end it at once (steps after the last checkpoint are lost).")
def command(run_dir: Path | None, runs_dir: Path, grace: float, now: bool) -> None:
    """Ask RUN_DIR (default: the newest run) to checkpoint and stop; end what is left after --grace."""
    from primebuild.contracts.plan import read_plan
    from primebuild.runtime.supervisor import GRACE_SECONDS, TERM_SECONDS
    from primebuild.runtime.targets import ended_outcome, target_for

    run = find_run(run_dir, runs_dir)
    read_plan(run.plan)  # a folder whose plan does not read is no run: nothing to stop, nothing written
    record = run.read_launch()
    if record is not None and (ended := ended_outcome(run, record)) is not None:
        click.echo(f"{run.root} has already ended ({ended.message}): nothing to stop")
        return
    run.stop_file.touch()
    if record is None:
        click.echo(f"stop requested for {run.root}; continue later with `primebuild run --resume {run.root}`")
        return
    target = target_for(record.target)
    # the supervisor gives the trainer GRACE_SECONDS, then ends the rest in up to TERM_SECONDS: a stop that
    # signals on the same second records a kill instead of the stop that was asked for
    own_end = max(grace, GRACE_SECONDS + TERM_SECONDS + 5) if grace >= GRACE_SECONDS else grace
    deadline = time.monotonic() + (0 if now else own_end)
    while time.monotonic() < deadline and target.active(run, record):
        time.sleep(POLL_SECONDS)
    if target.active(run, record):
        click.echo(target.stop(run, record))
        ended = time.monotonic() + TERM_SECONDS + 5  # the supervisor ends the workers, records the outcome
        while time.monotonic() < ended and target.active(run, record):
            time.sleep(POLL_SECONDS)
    click.echo(f"stopped {run.root} ({target.state(run, record)}); continue later with "
               f"`primebuild run --resume {run.root}`")
