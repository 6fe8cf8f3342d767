"""`primebuild store path|ls|gc|verify`: inspect and clean the content-addressed store.

Light imports only (stdlib + the store module): these commands must start instantly.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.builders.store import Store, StoreEntry, default_store_root
from primebuild.errors import Problem, UserError

_OUTPUT = click.option(
    "-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True
)


@click.group("store")
@click.option(
    "--store",
    "store_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Store directory (default: $PRIMEBUILD_STORE or ~/.cache/primebuild/store).",
)
@click.pass_context
def command(ctx: click.Context, store_dir: Path | None) -> None:
    """Content-addressed store of build outputs (images, checkpoints, rendered artifacts)."""
    ctx.ensure_object(dict)
    ctx.obj["store"] = Store(store_dir or default_store_root())


def _store(ctx: click.Context) -> Store:
    return ctx.obj["store"]


@command.command("path")
@click.argument("ref", required=False)
@click.pass_context
def path_cmd(ctx: click.Context, ref: str | None) -> None:
    """Print the store directory, or the path of entry REF (key, hash prefix or name) after checking it."""
    store = _store(ctx)
    if ref is None:
        click.echo(str(store.root))
        return
    entry_path = store.resolve(ref)
    store.verify(entry_path)
    click.echo(str(entry_path))


@command.command("ls")
@_OUTPUT
@click.pass_context
def ls_cmd(ctx: click.Context, output: str) -> None:
    """List entries (without re-hashing them; use `verify` for that)."""
    store = _store(ctx)
    rows = []
    for item in store.ls():
        if isinstance(item, StoreEntry):
            size = sum(row[3] for row in item.files if row[1] == "file")
            rows.append(
                {"key": item.key, "name": item.name, "path": str(item.path), "size": size, "record": "ok"}
            )
        else:
            rows.append(
                {
                    "key": item.name,
                    "name": item.name.split("-", 1)[1],
                    "path": str(item),
                    "size": None,
                    "record": "unreadable",
                }
            )
    if output == "json":
        click.echo(json.dumps({"store": str(store.root), "entries": rows}, indent=2))
        return
    if not rows:
        click.echo(f"(store {store.root} is empty)")
    for row in rows:
        size = _human(row["size"]) if row["size"] is not None else "?"
        note = "" if row["record"] == "ok" else "  (broken: unreadable record)"
        click.echo(f"{size:>9}  {row['key']}{note}")


@command.command("verify")
@click.argument("refs", nargs=-1)
@click.option("--fast", is_flag=True, help="Trust the stat fingerprint of the last full check (no re-read).")
@_OUTPUT
@click.pass_context
def verify_cmd(ctx: click.Context, refs: tuple[str, ...], fast: bool, output: str) -> None:
    """Re-hash entries REFS (default: all) and fail if any was modified after it was built."""
    store = _store(ctx)
    if refs:
        paths = [store.resolve(r) for r in refs]
    else:
        paths = [item if isinstance(item, Path) else item.path for item in store.ls()]
    results, problems = [], []
    for path in paths:
        try:
            store.verify(path, full=not fast)
            results.append({"key": path.name, "ok": True})
        except UserError as err:
            results.append({"key": path.name, "ok": False, "error": err.render()})
            problems.extend(err.problems)
    if output == "json":
        click.echo(json.dumps({"store": str(store.root), "results": results}, indent=2))
    else:
        for r in results:
            click.echo(f"{'ok    ' if r['ok'] else 'BROKEN'}  {r['key']}")
    if problems:
        raise UserError([Problem(p.message, file=p.file, hint=p.hint) for p in problems])


@command.command("gc")
@click.option(
    "--keep", "keep", multiple=True, help="Entry to keep (key, path, hash prefix or name); repeatable."
)
@click.option("--broken", is_flag=True, help="Remove only broken entries and leftovers of crashed builds.")
@click.option("--all", "remove_all", is_flag=True, help="Remove every entry not named by --keep.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
@_OUTPUT
@click.pass_context
def gc_cmd(
    ctx: click.Context, keep: tuple[str, ...], broken: bool, remove_all: bool, dry_run: bool, output: str
) -> None:
    """Remove broken entries and crash leftovers, and (with --keep/--all) everything not kept.

    Entries referenced by a kept entry's inputs are kept too. Builds in progress, and the entries a
    running run uses (its model, its teacher), are never touched.
    """
    if not (keep or broken or remove_all):
        raise click.UsageError("say what to remove: --broken, --keep REF … (removes the rest) or --all")
    if broken and (keep or remove_all):
        raise click.UsageError("--broken removes only broken entries; do not combine it with --keep/--all")
    store = _store(ctx)
    report = store.gc(keep, broken_only=broken, dry_run=dry_run)
    if output == "json":
        click.echo(
            json.dumps(
                {
                    "store": str(store.root),
                    "dry_run": dry_run,
                    "removed": report.removed,
                    "broken": report.broken,
                    "kept": report.kept,
                    "in_use": report.in_use,
                    "freed_bytes": report.freed_bytes,
                },
                indent=2,
            )
        )
        return
    verb = "would remove" if dry_run else "removed"
    for name in report.removed:
        click.echo(f"{verb} {name}{'  (broken)' if name in report.broken else ''}")
    for name in report.in_use:
        click.echo(f"kept {name}  (in use by a running run or build)")
    click.echo(f"{verb} {len(report.removed)} path(s), {_human(report.freed_bytes)}; kept {len(report.kept)}")


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
