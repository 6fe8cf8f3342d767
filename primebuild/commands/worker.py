"""`primebuild worker`: run one process of a plan on this host (what every target starts)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("worker")
@click.option("--plan", "plan_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--process", "name", required=True, help="Process name from the plan.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run folder (default: the plan's folder).")
@click.option("--session", is_flag=True, help="Start a new process group first (what the ssh target asks).")
@click.option("--env-from-stdin", "stdin_env", is_flag=True,
              help="Read NAME=value lines (secrets) from stdin up to an empty line.")
def command(plan_path: Path, name: str, run_dir: Path | None, session: bool, stdin_env: bool) -> None:
    """Become process NAME of the plan (exec)."""
    from primebuild.runtime.worker import exec_process

    exec_process(plan_path, name, (run_dir or plan_path.parent).resolve(), session=session, stdin_env=stdin_env)
