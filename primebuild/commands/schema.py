"""`primebuild schema`: print the manifest JSON Schema (for editors and the yaml-language-server)."""

from __future__ import annotations

import json

import click

from primebuild.manifest.schema import json_schema


@click.command("schema")
def command() -> None:
    """Print the JSON Schema of manifests (apiVersion primebuild/v1)."""
    click.echo(json.dumps(json_schema(), indent=2, sort_keys=True))
