"""`primebuild replay RUN_DIR`: check that a recorded run still compiles to the same plan, then rerun it.

A run folder records the composed manifest (`manifest.json`), the files it was read from
(`manifests/`), the plan (`plan.json`), the code version (`run.json`) and, when there was one, the
lock (`lock.json`). Replay recompiles the recorded manifest with today's code and refuses, showing
the plan differences field by field, when the plan hash is not the recorded one (code, model facts
or lock changed). Then it starts the run through `primebuild run`, exactly as a person would.

Relative paths in a manifest (`facts: models/x.json`, `from_manifest: x.yaml`) are resolved in a
manifest folder: `--manifest-dir`, else the first of ./manifests and the checkout's manifests/ that
holds a byte-identical copy of a recorded manifest file. The recorded manifest is placed in a
scratch folder that mirrors that folder (symlinks), so that nothing is written into the checkout.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from primebuild.commands.options import output_option
from primebuild.contracts.plan import PLAN_VERSION, Plan, plan_hash, read_plan
from primebuild.contracts.run_dir import RunDir
from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json


@click.command("replay")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--manifest-dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Folder the recorded manifest's relative paths refer to (default: found by content).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the new run folder is created (default: beside RUN_DIR).")
@click.option("--check", "check_only", is_flag=True, help="Only verify the plan hash and code; start nothing.")
@click.option("--allow-code-change", is_flag=True,
              help="Replay although today's code is not the recorded code version (the plan must still match).")
@click.option("--quiet", is_flag=True, help="Only progress lines, not every process's log lines.")
@output_option
def command(run_dir: Path, manifest_dir: Path | None, runs_dir: Path | None, check_only: bool,
            allow_code_change: bool, quiet: bool, output: str) -> None:
    """Verify RUN_DIR's recorded plan against today's code and rerun it."""
    run_dir = run_dir.resolve()
    base_dir = manifest_dir.resolve() if manifest_dir else find_manifest_dir(run_dir)
    with tempfile.TemporaryDirectory(prefix="primebuild-replay-") as tmp:
        manifest_path = stage_manifest(run_dir, base_dir, Path(tmp))
        plan = verify(run_dir, manifest_path)
        recorded_code, code, changes = compare_code(run_dir, allow_code_change)
        if output == "json":
            click.echo(json.dumps({"run_dir": str(run_dir), "plan_hash": plan.plan_hash, "verified": True,
                                   "code_version": {"recorded": recorded_code, "now": code, "changes": changes},
                                   "started": not check_only}, indent=2, sort_keys=True))
        else:
            click.echo(f"plan {plan.plan_hash[:16]} matches the recorded run {run_dir.name}")
            if changes:
                click.echo(f"code differs from the recorded run's ({recorded_code} -> {code}); replaying anyway "
                           "(--allow-code-change):\n" + "\n".join(f"    {line}" for line in changes))
        if check_only:
            return
        from primebuild.commands.run import command as run_command

        argv = [str(manifest_path), "--runs-dir", str(runs_dir or run_dir.parent)] + (["--quiet"] if quiet else [])
        run_command.main(argv, standalone_mode=False)


def verify(run_dir: Path, manifest_path: Path) -> Plan:
    """Recompile the recorded manifest (with the recorded lock, if the plan used one) and compare."""
    from primebuild.builders.diff import diff_values, render_changes
    from primebuild.builders.lock import lock_hash, read_lock
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    run = RunDir(run_dir)
    recorded_json = _read_json(run.plan)
    if recorded_json.get("plan_version") != PLAN_VERSION:  # another plan format: it cannot hash the same
        raise UserError(f"{run.plan}: plan_version {recorded_json.get('plan_version')!r}; today's code writes "
                        f"{PLAN_VERSION}", hint="check out the recorded code version to replay this run")
    recorded = read_plan(run.plan)
    if plan_hash(recorded_json) != recorded.plan_hash:  # comparing hashes alone would let an edit through
        raise UserError(f"{run.plan} was edited after the run compiled it: its content does not hash to its "
                        f"plan_hash {recorded.plan_hash[:16]}", hint="`primebuild diff` against a run of the same "
                        "manifest shows what changed; replay the run folder as it was recorded")
    lock = None
    if recorded.lock_hash:
        if not run.lock.is_file():
            raise UserError(f"{run_dir}: the recorded plan was made with a lock, but {run.lock.name} is missing")
        lock = read_lock(run.lock)
        if lock_hash(lock) != recorded.lock_hash:
            raise UserError(f"{run.lock} is not the lock the run used (its hash differs from the plan's lock_hash)")
    try:
        loaded = load_manifest(manifest_path)
    except UserError as err:  # name the run's record, not the scratch copy (the same bytes, so the same lines)
        raise UserError([Problem(p.message, file=str(run.manifest) if p.file == str(manifest_path) else p.file,
                                 line=p.line, column=p.column, field=p.field, hint=p.hint)
                         for p in err.problems]) from None
    plan = compile_plan(loaded, lock)
    if recorded.image is not None:  # the plan named an image: name the same one
        from primebuild.builders.lock import plan_with_image

        plan = plan_with_image(plan, recorded.image.digest)
    if plan.plan_hash != recorded.plan_hash:
        changes = diff_values({k: v for k, v in recorded_json.items() if k != "plan_hash"},
                              {k: v for k, v in plan.to_json().items() if k != "plan_hash"})
        from primebuild.code_version import code_changes, code_version

        code = run.read_json(run.run_record).get("code_version", "unknown")
        lines = render_changes(changes).splitlines() + [f"code: {line}" for line in code_changes(code, code_version())]
        raise UserError(
            f"{run_dir}: today's plan differs from the recorded one (recorded {recorded.plan_hash[:16]}, "
            f"now {plan.plan_hash[:16]}; the run was made by code {code}):\n"
            + "\n".join(f"    {line}" for line in lines),
            hint="check out the recorded code version, or start a new run with `primebuild run`")
    return plan


def compare_code(run_dir: Path, allow_change: bool) -> tuple[str, str, list[str]]:
    """(recorded code version, today's, what changed); a change is refused unless `allow_change`."""
    from primebuild.code_version import code_changes, code_version

    run = RunDir(run_dir)
    recorded = run.read_json(run.run_record).get("code_version")
    now = code_version()
    if not isinstance(recorded, str) or not recorded:
        recorded, changes = "unknown", ["run.json records no code version: the code that ran cannot be compared"]
    else:
        changes = code_changes(recorded, now)
    if changes and not allow_change:
        raise UserError(f"{run_dir}: the plan matches, but today's code is not the code that made the run "
                        f"(recorded {recorded}, now {now}):\n" + "\n".join(f"    {line}" for line in changes),
                        hint=f"check out {recorded.partition('-dirty')[0][:12]} to replay it exactly, or pass "
                             "--allow-code-change to replay the same plan with today's code")
    return recorded, now, changes


def find_manifest_dir(run_dir: Path) -> Path:
    from primebuild.builders.python_env import PROJECT_DIR

    copies = {p.name: p.read_bytes() for p in sorted(RunDir(run_dir).manifests.glob("*")) if p.is_file()}
    candidates = [Path.cwd() / "manifests", PROJECT_DIR / "manifests"]
    for folder in candidates:
        if any((folder / name).is_file() and (folder / name).read_bytes() == data for name, data in copies.items()):
            return folder.resolve()
    for folder in candidates:
        if folder.is_dir():
            return folder.resolve()
    raise UserError(f"cannot tell which folder {run_dir}'s manifest paths are relative to",
                    hint="pass --manifest-dir (the folder that held the manifest)")


STAGED_NAME = "replay-manifest.json"


def stage_manifest(run_dir: Path, base_dir: Path, scratch: Path) -> Path:
    """Copy the recorded composed manifest into `scratch` (its very bytes: errors keep their lines), next to
    links to everything else in `base_dir`; a file of base_dir's with the staged name is not linked, so the
    copy can never be written through a link into the user's folder."""
    recorded = RunDir(run_dir).manifest
    _read_json(recorded)  # a run record that reads as an object, or a located error
    for entry in sorted(base_dir.iterdir()):
        if entry.name != STAGED_NAME:
            os.symlink(entry, scratch / entry.name)
    target = scratch / STAGED_NAME
    with open(target, "xb") as out:  # exclusive: never through an existing file or link
        out.write(recorded.read_bytes())
    return target


def _read_json(path: Path) -> dict:
    return read_json(path, what=f"the run record {path.name}", want_object=True,
                     hint=f"{path.parent} is not a run folder (runs/<name>-<time>)?")
