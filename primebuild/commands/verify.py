"""`primebuild verify [RUN_DIR]`: check every checkpoint and published weight folder of a run against the
file listing in its STABLE marker (sizes and sha256), as the trainer and the servers do before loading."""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.commands.options import output_option, run_dir_argument, runs_dir_option
from primebuild.contracts.run_dir import find_run


@click.command("verify")
@run_dir_argument
@runs_dir_option
@output_option
def command(run_dir: Path | None, runs_dir: Path, output: str) -> None:
    """Verify RUN_DIR's (default: the newest run's) checkpoints/ and weights/ step folders; exit 2 if any is
    damaged or incomplete."""
    from primebuild.runtime.weight_sync.filesystem import DamagedFolder, step_folder, step_folders, verify

    run = find_run(run_dir, runs_dir)
    rows = []
    for kind, root in (("checkpoint", run.checkpoints), ("weights", run.weights)):
        if root.exists() and not root.is_dir():  # its step folders cannot be there: not "0 damaged"
            rows.append({"kind": kind, "step": 0, "folder": str(root), "ok": False,
                         "problem": f"{root.name} is not a folder"})
            continue
        for step in step_folders(root):
            folder = step_folder(root, step)
            try:
                verify(folder)
                rows.append({"kind": kind, "step": step, "folder": str(folder), "ok": True, "problem": None})
            except (DamagedFolder, FileNotFoundError) as err:
                if not folder.exists():  # a running run's retention removed it meanwhile: nothing to verify
                    continue
                what = err.what if isinstance(err, DamagedFolder) else f"{Path(err.filename or 'a file').name} is missing"
                rows.append({"kind": kind, "step": step, "folder": str(folder), "ok": False, "problem": what})
    if output == "json":
        click.echo(json.dumps({"run_dir": str(run.root), "folders": rows}, indent=2, sort_keys=True))
    else:
        for row in rows:
            state = "ok" if row["ok"] else f"DAMAGED: {row['problem']}"
            click.echo(f"{row['kind']:>10} step {row['step']:>6}  {state}")
        bad = sum(not r["ok"] for r in rows)
        click.echo(f"{len(rows)} folder(s) checked, {bad} damaged" if rows else "no checkpoint or weight folders")
    if any(not r["ok"] for r in rows):
        raise click.exceptions.Exit(2)
