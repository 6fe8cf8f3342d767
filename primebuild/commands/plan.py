"""`primebuild plan`: show exactly what would run where, and whether it fits. No side effects."""

from __future__ import annotations

import click

from primebuild.builders.plan import compile_plan, render_json
from primebuild.commands.options import manifest_argument, print_notes, set_option
from primebuild.manifest.load import load_manifest


@click.command("plan")
@manifest_argument
@set_option
@click.option("-o", "--output", type=click.Choice(["text", "json", "html"]), default="text", show_default=True,
              help="Tables, the canonical JSON, or one self-contained HTML page (node x GPU map, memory, step time).")
@click.option("--locked", is_flag=True,
              help="Use the manifest's lock (lockfiles/<stem>.lock); refuse it when stale or incomplete.")
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Use this lock file instead of the default one (implies --locked).")
@click.option("--image-digest", default=None, metavar="sha256:…",
              help="Name the image built for this plan (`primebuild build`) in the plan's `image` field.")
@click.option("--compact", is_flag=True, help="With -o json: the canonical JSON on one line.")
@click.option("--design", is_flag=True,
              help="Also compile what no built backend applies yet: a design study marked runnable: false.")
def command(manifest: str, sets: tuple[str, ...], output: str, locked: bool, lock_path: str | None,
            image_digest: str | None, compact: bool, design: bool) -> None:
    """Compile MANIFEST into a launch plan and print it.

    A field that the plan's backends cannot apply is an error (exit 2) naming it; with --design the
    plan is shown anyway, with those fields listed and `runnable: false`, and nothing can run it."""
    if compact and output != "json":
        raise click.UsageError("--compact shapes the JSON output: give it with -o json")
    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    lock = None
    if locked or lock_path:
        from primebuild.builders.lock import unpinned
        from primebuild.builders.lock_check import load_lock_for

        lock = load_lock_for(loaded, lock_path, require_fresh=True)
        print_notes([f"lock entry not pinned: {line}" for line in unpinned(lock)])
    plan = compile_plan(loaded, lock, design=design)
    if image_digest:
        from primebuild.builders.lock import plan_with_image

        plan = plan_with_image(plan, image_digest)
    if output == "json":
        click.echo(render_json(plan, compact=compact), nl=False)
    elif output == "html":
        from primebuild.builders.plan_html import render_plan_html

        click.echo(render_plan_html(plan), nl=False)
    else:
        from primebuild.commands.plan_view import show_plan

        show_plan(plan)
