"""`primebuild run`: execute a plan (local target), or continue a stopped run with --resume."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from primebuild.commands.options import print_notes, set_option
from primebuild.contracts.plan import Plan, read_plan, render_json
from primebuild.contracts.run_dir import Rendezvous, RunDir
from primebuild.errors import UserError


@click.command("run")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False, path_type=str))
@set_option
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
              show_default=True, help="Where run folders are created.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Continue a stopped run from its folder (checkpoints and rollouts on disk).")
@click.option("--quiet", "-q", is_flag=True, help="Only the progress lines (no process warnings).")
@click.option("--verbose", "-v", is_flag=True, help="Every line every process prints (access logs too).")
def command(manifest: str | None, sets: tuple[str, ...], runs_dir: Path, resume_dir: Path | None, quiet: bool,
            verbose: bool) -> None:
    """Run MANIFEST on this machine: build its model, start every process, report the result."""
    from primebuild.builders.plan import compile_plan
    from primebuild.builders.store import Store
    from primebuild.manifest.load import load_manifest

    started = time.monotonic()
    from primebuild.runtime.supervisor import ATTENTION, QUIET, VERBOSE

    if quiet and verbose:
        raise UserError("--quiet and --verbose contradict each other: give one")
    verbosity = QUIET if quiet else VERBOSE if verbose else ATTENTION
    if resume_dir is not None:
        if manifest or sets:
            raise UserError("--resume takes the run folder only: its plan and manifest are already recorded")
        run = RunDir(resume_dir.resolve()).require(resumable=True)
        plan = read_plan(run.plan)
        run.stop_file.unlink(missing_ok=True)
        from primebuild.runtime.resume import reconcile

        after = reconcile(run, click.echo)
        click.echo(f"resuming {run.root} after step {after}")
        _supervise(plan, run, verbosity, started, {})
        return
    if manifest is None:
        raise UserError("give a manifest (e.g. manifests/reverse-text.yaml) or --resume RUN_DIR")

    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    m = loaded.manifest
    plan = compile_plan(loaded)  # refuses, located, whatever the runtime would not apply
    store = Store()
    from primebuild.runtime.derivations import output_of, resolve_model

    if plan.build is not None:  # a model-building manifest: its output is the run
        built = output_of(loaded, store, click.echo)
        click.echo(f"{m.name}: {built.path} ({'cache hit' if built.cache_hit else 'built'} in {built.seconds:.2f} s); "
                   f"held-out reward {built.info.get('eval_reward')}")
        return

    from primebuild.runtime.supervisor import ports_in_use, ports_message

    busy = ports_in_use(plan)
    if busy:  # before anything is built or written
        raise UserError(ports_message(busy))
    model = resolve_model(loaded, store, click.echo)
    click.echo(f"model: {model.path} ({'cache hit' if model.cache_hit else 'built'} in {model.seconds:.2f} s)")

    run = RunDir((runs_dir / f"{m.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve())
    run.root.mkdir(parents=True, exist_ok=False)
    run.plan.write_text(render_json(plan))
    run.manifest.write_text(json.dumps(loaded.document, indent=2, sort_keys=True))
    for path in loaded.files:
        run.manifests.mkdir(exist_ok=True)
        (run.manifests / path.name).write_bytes(path.read_bytes())
    environments = {}
    if any(p.environment == "vllm" for p in plan.processes):
        from primebuild.runtime.inference.vllm.env import ensure

        environments["vllm"] = str(ensure(click.echo))
    rendezvous = Rendezvous(hosts=["127.0.0.1"] * m.hardware.nodes, model_path=str(model.path),
                            environments=environments)
    run.rendezvous.write_text(json.dumps(rendezvous.model_dump(mode="json"), indent=2))
    run.run_record.write_text(json.dumps(
        {"plan_hash": plan.plan_hash, "manifest_hash": loaded.manifest_hash, "code_version": _code_version(),
         "manifest_path": str(loaded.path.resolve()), "model_path": str(model.path),
         "model_cache_hit": model.cache_hit}, indent=2, sort_keys=True))
    from primebuild.builders.lock import record_lock

    record_lock(run.lock, loaded)  # the lock as it was, when the manifest has one
    click.echo(f"run folder: {run.root}")
    extra = {"sft": model.info, "model_seconds": round(model.seconds, 2)}
    _supervise(plan, run, verbosity, started, extra)


def _supervise(plan: Plan, run: RunDir, verbosity: int, started: float, extra: dict) -> None:
    from primebuild.runtime.report import write_report, write_summary
    from primebuild.runtime.supervisor import supervise

    if sys.stdout.isatty():  # a live panel under the scrolling log lines
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(), refresh_per_second=4) as live:
            def echo(text: str) -> None:
                live.console.print(text, markup=False, highlight=False)

            outcome = supervise(plan, run.root, echo=echo, verbosity=verbosity, live=live)
    else:
        outcome = supervise(plan, run.root, echo=click.echo, verbosity=verbosity)
    wall = time.monotonic() - started
    previous = run.read_json(run.summary)
    summary = write_summary(run, {**extra, "wall_seconds": round(previous.get("wall_seconds", 0) + wall, 2),
                                  "outcome": outcome.message})
    report = write_report(run)
    if "eval_reward_before" in summary:
        click.echo(f"eval reward before RL (SFT model): {summary['eval_reward_before']:.4f}")
    if "eval_reward_after" in summary:
        click.echo(f"eval reward after RL:              {summary['eval_reward_after']:.4f} "
                   f"(gain {summary['eval_reward_gain']:+.4f})")
    click.echo(f"wall time {summary['wall_seconds']:.1f} s; summary {run.summary}"
               + (f"; report {report}" if report else ""))
    if not outcome.ok:
        raise click.exceptions.Exit(_fail(outcome))
    click.echo(outcome.message)


def _fail(outcome) -> int:
    click.echo(f"error: {outcome.message}", err=True)
    return outcome.exit_code


def _code_version() -> str:
    import subprocess

    try:
        here = Path(__file__).resolve().parents[2]
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from primebuild import __version__

    return __version__
