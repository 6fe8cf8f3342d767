"""`primebuild diff A B`: what differs between two manifests, plans, locks or run folders.

Each side is read into sections: a manifest (.yaml/.yml, validated with defaults filled in) gives
`manifest`; a plan JSON gives `plan`; a lock gives `lock`; a run folder gives `manifest`, `plan`,
`lock` (when recorded) and `run` (code version, hashes). Sections present on both sides are compared
field by field (dotted paths, old -> new). Exit status as diff(1): 0 equal, 1 different, 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.commands.options import output_option
from primebuild.errors import UserError
from primebuild.json_file import read_json

_RUN_FIELDS_COMPARED = ("code_version", "manifest_hash", "plan_hash")  # not paths, clocks or cache hits


@click.command("diff")
@click.argument("a", type=click.Path(exists=True, path_type=Path))
@click.argument("b", type=click.Path(exists=True, path_type=Path))
@output_option
def command(a: Path, b: Path, output: str) -> None:
    """Show field by field what differs between A and B (manifests, plans, locks or run folders)."""
    from primebuild.builders.diff import diff_values, render_changes

    left, right = read_sections(a), read_sections(b)
    common = [s for s in ("manifest", "lock", "plan", "run") if s in left and s in right]
    if not common:
        raise UserError(f"nothing to compare: {a} holds {', '.join(left)} and {b} holds {', '.join(right)}",
                        hint="compare two manifests, two plans, two locks or two run folders")
    changes = {s: diff_values(left[s], right[s]) for s in common}
    differ = any(changes.values())
    if output == "json":
        click.echo(json.dumps({"equal": not differ, "compared": common,
                               "changes": {s: [c.to_json() for c in cs] for s, cs in changes.items()}},
                              indent=2, sort_keys=True, default=str))
    else:
        for section in common:
            if changes[section]:
                click.echo(f"{section}:")
                click.echo("\n".join(f"  {line}" for line in render_changes(changes[section]).splitlines()))
        if not differ:
            click.echo(f"no differences ({', '.join(common)})")
    if differ:
        raise click.exceptions.Exit(1)


def read_sections(path: Path) -> dict[str, dict]:
    if path.is_dir():
        return _run_folder(path)
    if path.suffix in (".yaml", ".yml"):
        return {"manifest": _manifest(path)}
    data = _json(path)
    if path.suffix == ".lock" or "lock_version" in data:
        return {"lock": data}
    if "plan_version" in data:
        return {"plan": data}
    if "apiVersion" in data:
        return {"manifest": _manifest(path)}
    raise UserError(f"{path}: not a manifest, plan, lock or run folder",
                    hint="a plan has `plan_version`, a lock `lock_version`, a manifest `apiVersion`")


def _manifest(path: Path) -> dict:
    from primebuild.manifest.load import load_manifest

    return load_manifest(path).manifest.model_dump(mode="json")


def _run_folder(path: Path) -> dict[str, dict]:
    """Plans are compared as their JSON (not parsed into today's Plan), so plans of older versions diff too."""
    from primebuild.contracts.run_dir import RunDir
    from primebuild.manifest.schema import Manifest

    run = RunDir(path).require()
    sections = {"plan": _json(run.plan)}
    if run.manifest.is_file():
        document = _json(run.manifest)
        try:  # with defaults filled in, as for a manifest file; the raw document if it no longer validates
            sections["manifest"] = Manifest.model_validate(document).model_dump(mode="json")
        except ValueError:
            sections["manifest"] = document
    if run.lock.is_file():
        sections["lock"] = _json(run.lock)
    if run.run_record.is_file():
        record = _json(run.run_record)
        sections["run"] = {k: record[k] for k in _RUN_FIELDS_COMPARED if k in record}
    return sections


def _json(path: Path) -> dict:
    return read_json(path, want_object=True)
