"""`primebuild stop RUN_DIR`: ask a running run to checkpoint and stop (what Ctrl-C does)."""

from __future__ import annotations

from pathlib import Path

import click

from primebuild.contracts.run_dir import RunDir


@click.command("stop")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def command(run_dir: Path) -> None:
    """Write RUN_DIR/STOP: the trainer checkpoints after its current step, the orchestrator stops."""
    RunDir(run_dir).require().stop_file.touch()
    click.echo(f"stop requested for {run_dir}; continue later with `primebuild run --resume {run_dir}`")
