"""`primebuild stop RUN_DIR`: ask a running run to checkpoint and stop (what Ctrl-C does)."""

from __future__ import annotations

from pathlib import Path

import click

from primebuild.errors import UserError


@click.command("stop")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def command(run_dir: Path) -> None:
    """Write RUN_DIR/STOP: the trainer checkpoints after its current step, the orchestrator stops."""
    if not (run_dir / "plan.json").is_file():
        raise UserError(f"{run_dir} is not a run folder (no plan.json)", hint="runs live under runs/ by default")
    (run_dir / "STOP").touch()
    click.echo(f"stop requested for {run_dir}; continue later with `primebuild run --resume {run_dir}`")
