"""`primebuild lock`: resolve and hash every floating input of a manifest into lockfiles/<stem>.lock."""

from __future__ import annotations

from pathlib import Path

import click

from primebuild.commands.options import manifest_argument, output_option, print_notes, set_option


@click.command("lock")
@manifest_argument
@set_option
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Lock file to write (default: lockfiles/<stem>.lock beside the manifests' folder).")
@click.option("--update", is_flag=True, help="Re-resolve every entry and show what changed.")
@click.option("--offline", is_flag=True, help="No network: pin from local caches only, record the rest.")
@output_option
def command(manifest: str, sets: tuple[str, ...], lock_path: Path | None, update: bool, offline: bool,
            output: str) -> None:
    """Pin MANIFEST's model, environments, Python packages and base image.

    An existing lock is kept: only entries that are missing, not pinned yet, or whose request changed
    are resolved. --update re-resolves everything and prints the differences.
    """
    import json

    from primebuild.builders import lock as lockmod
    from primebuild.builders.diff import diff_values, render_changes
    from primebuild.manifest.load import load_manifest

    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    path = lock_path or lockmod.lock_path_for(loaded)
    lockmod.check_writable(path)
    previous = lockmod.read_lock(path) if path.is_file() else None
    siblings = sorted(p for p in path.parent.glob(f"*{lockmod.LOCK_SUFFIX}") if p != path)
    lock = lockmod.make_lock(loaded, previous, update=update, offline=offline, sibling_locks=siblings,
                             echo=lambda msg: click.echo(msg, err=True))
    changes = diff_values(previous, lock) if previous is not None else []
    written = previous is None or bool(changes)
    if written:
        lockmod.write_lock(path, lock)
    missing = lockmod.unpinned(lock)
    if output == "json":
        click.echo(json.dumps({"lock": str(path), "written": written, "lock_hash": lockmod.lock_hash(lock),
                               "changes": [c.to_json() for c in changes], "unpinned": missing},
                              indent=2, sort_keys=True))
        return
    if previous is None:
        click.echo(f"wrote {path}")
    elif changes:
        click.echo(f"updated {path}:\n{render_changes(changes)}")
    else:
        click.echo(f"{path} is up to date")
    for line in missing:
        click.echo(f"warning: not pinned: {line}", err=True)
