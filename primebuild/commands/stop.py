"""`primebuild stop [RUN_DIR]`: stop a run gracefully, on any target (what Ctrl-C does).

Writes RUN_DIR/STOP: the trainer checkpoints after its current step and the orchestrator stops, so the
run ends by itself and `primebuild run --resume` continues it. What still runs after `--grace` seconds
is ended by the run's target (Slurm: scancel; Kubernetes: the pods' logs copied, the objects deleted; ssh and
local: the process groups the workers recorded). The sequence is primebuild/runtime/targets/stopping.py's.
"""

from __future__ import annotations

from pathlib import Path

import click

from primebuild.commands.options import run_dir_argument, runs_dir_option
from primebuild.contracts.run_dir import find_run


@click.command("stop")
@run_dir_argument
@runs_dir_option
@click.option("--grace", type=click.FloatRange(min=0, max=3600), default=60.0, show_default=True,
              help="Seconds the run may take to checkpoint and end by itself before its target ends it.")
@click.option("--now", is_flag=True, help="No grace: end it at once (steps after the last checkpoint are lost).")
def command(run_dir: Path | None, runs_dir: Path, grace: float, now: bool) -> None:
    """Ask RUN_DIR (default: the newest run) to checkpoint and stop; end what is left after --grace."""
    from primebuild.contracts.plan import read_plan
    from primebuild.runtime.targets import ended_outcome, target_for
    from primebuild.runtime.targets.base import TargetUnanswered
    from primebuild.runtime.targets.stopping import stop_gracefully

    run = find_run(run_dir, runs_dir)
    read_plan(run.plan)  # a folder whose plan does not read is no run: nothing to stop, nothing written
    record = run.read_launch()
    try:
        ended = ended_outcome(run, record) if record is not None else None
    except TargetUnanswered:
        ended = None  # unknown: stop it as a running one (the wait below says the cluster does not answer)
    if ended is not None:
        click.echo(f"{run.root} has already ended ({ended.message}): nothing to stop")
        return
    if record is None:
        run.stop_file.touch()
        click.echo(f"stop requested for {run.root}; continue later with `primebuild run --resume {run.root}`")
        return
    target = target_for(record.target)
    stop_gracefully(target, run, record, grace=0 if now else grace, echo=click.echo)
    click.echo(f"stopped {run.root} ({target.state(run, record)}); continue later with "
               f"`primebuild run --resume {run.root}`")
