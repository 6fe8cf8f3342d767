"""Options shared by the commands that read a manifest."""

from __future__ import annotations

from pathlib import Path

import click

manifest_argument = click.argument("manifest", type=click.Path(dir_okay=False, path_type=str))
set_option = click.option(
    "--set", "sets", multiple=True, metavar="PATH=VALUE",
    help="Override a manifest field, typed by the schema (e.g. --set trainer.dp_shard=16). Repeatable.")
output_option = click.option(
    "-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="Human summary or canonical JSON.")


run_dir_argument = click.argument("run_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
runs_dir_option = click.option(
    "--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"), show_default=True,
    help="Where run folders are; without RUN_DIR the newest one there is used.")


def print_notes(notes: list[str]) -> None:
    for note in notes:
        click.echo(f"note: {note}", err=True)
