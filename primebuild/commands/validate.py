"""`primebuild validate`: check a manifest against the schema; report every problem at once."""

from __future__ import annotations

import json

import click

from primebuild.commands.options import manifest_argument, output_option, print_notes, set_option
from primebuild.manifest.load import load_manifest


@click.command("validate")
@manifest_argument
@set_option
@output_option
def command(manifest: str, sets: tuple[str, ...], output: str) -> None:
    """Validate MANIFEST (syntax, schema, extends chain, --set overrides)."""
    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    if output == "json":
        click.echo(json.dumps({"valid": True, "name": loaded.manifest.name, "manifest_hash": loaded.manifest_hash,
                               "files": len(loaded.files)}, sort_keys=True))
    else:
        click.echo(f"{manifest}: valid ({loaded.manifest.name}, manifest hash {loaded.manifest_hash[:16]})")
