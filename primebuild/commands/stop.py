"""`primebuild stop RUN_DIR`: ask a running run to checkpoint and stop (what Ctrl-C does)."""

from __future__ import annotations

from pathlib import Path

import click

from primebuild.commands.options import run_dir_argument, runs_dir_option
from primebuild.contracts.run_dir import find_run


@click.command("stop")
@run_dir_argument
@runs_dir_option
def command(run_dir: Path | None, runs_dir: Path) -> None:
    """Write RUN_DIR/STOP: the trainer checkpoints after its current step, the orchestrator stops."""
    run = find_run(run_dir, runs_dir)
    run.stop_file.touch()
    run_dir = run.root
    click.echo(f"stop requested for {run_dir}; continue later with `primebuild run --resume {run_dir}`")
