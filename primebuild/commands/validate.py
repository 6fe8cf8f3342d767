"""`primebuild validate`: check a manifest against the schema and the backends; report every problem at once.

What depends on this machine's packages, the model's architecture (its config.json), the placement and the
fit is `plan`'s."""

from __future__ import annotations

import json

import click

from primebuild.builders.plan import manifest_problems
from primebuild.commands.options import manifest_argument, output_option, print_notes, set_option
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest


@click.command("validate")
@manifest_argument
@set_option
@output_option
def command(manifest: str, sets: tuple[str, ...], output: str) -> None:
    """Validate MANIFEST: syntax, schema, extends chain, --set overrides, environment ids and args, and fields
    no built backend applies. `plan` also checks what this machine has installed, the model's
    architecture, the placement and the fit."""
    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    if problems := manifest_problems(loaded):
        raise UserError(problems)
    if output == "json":
        click.echo(json.dumps({"valid": True, "name": loaded.manifest.name, "manifest_hash": loaded.manifest_hash,
                               "files": len(loaded.files)}, sort_keys=True))
    else:
        click.echo(f"{manifest}: valid ({loaded.manifest.name}, manifest hash {loaded.manifest_hash[:16]})")
