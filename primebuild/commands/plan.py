"""`primebuild plan`: show exactly what would run where, and whether it fits. No side effects."""

from __future__ import annotations

import click

from primebuild.builders.plan import compile_plan, render_json
from primebuild.commands.options import manifest_argument, output_option, print_notes, set_option
from primebuild.manifest.load import load_manifest


@click.command("plan")
@manifest_argument
@set_option
@output_option
def command(manifest: str, sets: tuple[str, ...], output: str) -> None:
    """Compile MANIFEST into a launch plan and print it."""
    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    plan = compile_plan(loaded)
    if output == "json":
        click.echo(render_json(plan), nl=False)
    else:
        from primebuild.commands.plan_view import show_plan

        show_plan(plan)
